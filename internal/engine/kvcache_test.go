package engine

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/engine/kvcache"
	"github.com/polykv/polykv/internal/pool"
)

// The KV-cache manager (package kvcache) is the one home of cell changes and the only
// place that evicts. The cell tree's changes (write, remove, share) are unexported, so
// the compiler keeps package engine to reading it; inside package kvcache only the
// Manager (kvcache/kvcache.go) calls them, so every change is planned as a sequence
// operation. No non-test code of package engine walks the victims (an eviction loop of
// its own, as the draft room once was): it asks MakeRoom or DraftRoom.
func TestOnlyTheManagerChangesCells(t *testing.T) {
	fset := token.NewFileSet()
	inspect := func(glob string, skip func(name string) bool, f func(name string, call *ast.CallExpr, sel *ast.SelectorExpr)) int {
		files, err := filepath.Glob(glob)
		if err != nil {
			t.Fatal(err)
		}
		checked := 0
		for _, name := range files {
			if strings.HasSuffix(name, "_test.go") || skip(name) {
				continue
			}
			file, err := parser.ParseFile(fset, name, nil, 0)
			if err != nil {
				t.Fatal(err)
			}
			checked++
			ast.Inspect(file, func(n ast.Node) bool {
				if call, ok := n.(*ast.CallExpr); ok {
					if sel, ok := call.Fun.(*ast.SelectorExpr); ok {
						f(name, call, sel)
					}
				}
				return true
			})
		}
		return checked
	}
	n := inspect("kvcache/*.go", func(name string) bool { return filepath.Base(name) == "kvcache.go" }, func(name string, call *ast.CallExpr, sel *ast.SelectorExpr) {
		switch sel.Sel.Name {
		case "write", "remove", "share":
			if filepath.Base(name) != "celltree.go" { // the tree's own methods build on each other
				t.Errorf("%s: %s changes the cell tree outside the Manager (kvcache/kvcache.go)", fset.Position(call.Pos()), sel.Sel.Name)
			}
		case "victims", "Victims":
			t.Errorf("%s: victims walked outside the Manager (kvcache/kvcache.go): only it evicts", fset.Position(call.Pos()))
		}
	})
	if n < 1 {
		t.Fatal("checked no file of package kvcache: the test is not looking at it")
	}
	n = inspect("*.go", func(string) bool { return false }, func(name string, call *ast.CallExpr, sel *ast.SelectorExpr) {
		if sel.Sel.Name == "Victims" {
			t.Errorf("%s: victims walked outside the KV-cache manager (package kvcache): only it evicts", fset.Position(call.Pos()))
		}
	})
	if n < 10 {
		t.Fatalf("checked only %d files: the test is not looking at the package", n)
	}
}

// TestDraftRoomAsksTheManager: the draft room is a request to the KV-cache manager
// (kvcache.Manager.DraftRoom): it takes up to the cells asked for from idle sequences' tails,
// what only they hold, in the manager's victim order, and never a pool, even one past
// its grace time that makeRoom would take whole; what it took leaves the cache and the
// accounting agreeing.
func TestDraftRoomAsksTheManager(t *testing.T) {
	h := newHarness(t, poolCfg())
	id := h.createPool(PoolSpec{Tokens: seqTokens(1, 40)})
	h.now = h.now.Add(2 * time.Second)
	h.submit(Request{Prompt: seqTokens(200, 30), SessionID: "T", MaxTokens: 1})
	h.run()
	h.now = h.now.Add(2 * time.Second)
	h.step() // the pool is past its grace time: a victim
	p, err := h.s.pools.Get(id)
	if err != nil {
		t.Fatal(err)
	}
	vs := h.s.kv.Victims(h.s.now, -1)
	if !slices.ContainsFunc(vs, func(v kvcache.Holder) bool { return victimOf(v).p == p }) {
		t.Fatal("the pool is not a victim: the test would not show the draft room passes it over")
	}
	session := h.s.bySession["T"]
	had := len(session.tokens)
	if got := h.s.draftRoom(5); got != 5 || len(session.tokens) != had-5 {
		t.Fatalf("draft room of 5: freed %d, the session holds %d of %d", got, len(session.tokens), had)
	}
	if got := h.s.draftRoom(1000); got != had-5 || len(session.tokens) != 0 {
		t.Fatalf("draft room of 1000: freed %d, want the session's other %d", got, had-5)
	}
	if p.State != pool.Resident || p.Filled() != p.L() {
		t.Fatalf("the draft room took the pool: %s holding %d of %d", p.State, p.Filled(), p.L())
	}
	h.step()
	h.checkAccounting()
}
