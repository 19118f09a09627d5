package bench

import (
	"os"
	"path/filepath"
	"testing"
)

// dropPageCache leaves none of a just-written file's pages in the page cache (what
// bench --workload tier's disk-cold row relies on), and counts every page.
func TestDropPageCache(t *testing.T) {
	dir := t.TempDir()
	size := 64*os.Getpagesize() + 1
	if err := os.WriteFile(filepath.Join(dir, "entry.kv"), make([]byte, size), 0o644); err != nil {
		t.Fatal(err)
	}
	resident, total, err := dropPageCache(dir)
	if err != nil {
		t.Fatal(err)
	}
	if resident != 0 || total != 65 {
		t.Fatalf("after the drop: %d of %d pages resident, want 0 of 65", resident, total)
	}
}
