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

	"github.com/polykv/polykv/internal/pool"
)

// The KV-cache manager is the one home of cell changes: outside kvcache.go no code of
// the package calls the cell tree's Append, Rm or Cp (it would change cells behind the
// manager's plan of sequence operations). Readers may still look at kv.cells. It is
// also the only place that evicts: no code outside it walks the victims (an eviction
// loop of its own, as the draft room once was).
func TestOnlyTheManagerChangesCells(t *testing.T) {
	files, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	checked := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") || name == "kvcache.go" || name == "celltree.go" {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		checked++
		ast.Inspect(f, func(n ast.Node) bool {
			call, ok := n.(*ast.CallExpr)
			if !ok {
				return true
			}
			sel, ok := call.Fun.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			switch sel.Sel.Name {
			case "Append", "Rm", "Cp":
				if x, ok := sel.X.(*ast.SelectorExpr); ok && x.Sel.Name == "cells" {
					t.Errorf("%s: %s changes the cell tree outside the KV-cache manager (kvcache.go)", fset.Position(call.Pos()), sel.Sel.Name)
				}
			case "victims":
				t.Errorf("%s: victims walked outside the KV-cache manager (kvcache.go): only it evicts", fset.Position(call.Pos()))
			}
			return true
		})
	}
	if checked < 10 {
		t.Fatalf("checked only %d files: the test is not looking at the package", checked)
	}
}

// TestDraftRoomAsksTheManager: the draft room is a request to the KV-cache manager
// (kvCache.draftRoom): it takes up to the cells asked for from idle sequences' tails,
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
	vs := h.s.kv.victims(h.s.now, nil)
	if !slices.ContainsFunc(vs, func(v victim) bool { return v.p == p }) {
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
