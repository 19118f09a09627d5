package engine

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"
)

// The KV-cache manager is the one home of cell changes: outside kvcache.go no code of
// the package calls the cell tree's Append, Rm or Cp (it would change cells behind the
// manager's plan of sequence operations). Readers may still look at kv.cells.
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
			}
			return true
		})
	}
	if checked < 10 {
		t.Fatalf("checked only %d files: the test is not looking at the package", checked)
	}
}
