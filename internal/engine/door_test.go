package engine

import (
	"go/ast"
	"go/parser"
	"go/token"
	"testing"
)

// TestOneDoor: the engine loop's side (engine.go, driver.go) reaches the scheduler only
// through its door: Step, Ready, Commit, Snapshot, and useBackend once at New. No
// field of the scheduler and no other method is touched from there (draft rounds, tier
// restores, slot copies and probes are plan operations and answer messages), and the
// driver calls the backend's abilities only through Caps (no type assertion on it).
func TestOneDoor(t *testing.T) {
	door := map[string]bool{"Step": true, "Ready": true, "Commit": true, "Snapshot": true, "useBackend": true}
	abilities := map[string]bool{"DraftBackend": true, "DraftChecker": true, "TierBackend": true, "SeqTierBackend": true,
		"AsyncTierBackend": true, "SlotBackend": true, "CellProber": true}
	fset := token.NewFileSet()
	for _, name := range []string{"engine.go", "driver.go"} {
		f, err := parser.ParseFile(fset, name, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		// The names a *Scheduler is known by: parameters and receivers of that type.
		scheds := map[string]bool{}
		uses := 0
		ast.Inspect(f, func(n ast.Node) bool {
			switch n := n.(type) {
			case *ast.Field:
				if st, ok := n.Type.(*ast.StarExpr); ok {
					if id, ok := st.X.(*ast.Ident); ok && id.Name == "Scheduler" {
						for _, nm := range n.Names {
							scheds[nm.Name] = true
						}
					}
				}
			case *ast.TypeAssertExpr:
				if id, ok := n.Type.(*ast.Ident); ok && abilities[id.Name] {
					t.Errorf("%s: the backend asserted to be a %s (declare the ability in Caps)", fset.Position(n.Pos()), id.Name)
				}
			}
			return true
		})
		ast.Inspect(f, func(n ast.Node) bool {
			sel, ok := n.(*ast.SelectorExpr)
			if !ok {
				return true
			}
			if id, ok := sel.X.(*ast.Ident); ok && scheds[id.Name] {
				uses++
				if !door[sel.Sel.Name] {
					t.Errorf("%s: %s.%s reaches into the scheduler outside its door", fset.Position(sel.Pos()), id.Name, sel.Sel.Name)
				}
			}
			return true
		})
		if len(scheds) == 0 || uses == 0 {
			t.Errorf("%s: no use of the scheduler found: the test is not looking at it", name)
		}
	}
}
