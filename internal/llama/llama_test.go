package llama

import (
	"testing"

	"github.com/polykv/polykv/internal/testmodel"
)

// testModel loads SmolLM2-135M (make model); without it the test skips, unless
// POLYKV_REQUIRE_MODEL is set (make test), where a missing model fails.
func testModel(t *testing.T) *Model {
	t.Helper()
	p := testmodel.SmolLM2(t)
	m, err := LoadModel(p)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Free)
	return m
}

// TestKVBytesPerCellMatchesCache checks the accounting's bytes per cell against what
// llama.cpp itself stores: the saved state of a sequence grows by (bytes per cell + 12
// bytes of position and membership) per cell, for each cache type.
func TestKVBytesPerCellMatchesCache(t *testing.T) {
	m := testModel(t)
	if got := m.KVBytesPerCell(); got != 23040 {
		t.Fatalf("f16 bytes per cell %d, want 23040 (30 layers × 3 kv heads × (64+64) × 2 B)", got)
	}
	for _, ty := range []struct{ k, v CacheType }{{"f16", "f16"}, {"q8_0", "q8_0"}, {"q4_0", "q4_0"}, {"q8_0", "f16"}} {
		c, err := NewContext(m, ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: 2, KVUnified: true, FlashAttn: 1, TypeK: ty.k, TypeV: ty.v})
		if err != nil {
			t.Fatalf("%s/%s: %v", ty.k, ty.v, err)
		}
		var sizes []int64
		for _, n := range []int{8, 16} {
			c.BatchClear()
			for pos := 0; pos < n; pos++ {
				if _, err := c.BatchAdd(Token(100+pos), pos, 0, pos == n-1); err != nil {
					t.Fatal(err)
				}
			}
			if err := c.Decode(); err != nil {
				t.Fatal(err)
			}
			sizes = append(sizes, c.SeqStateSize(0))
			c.SeqRm(0, 0, -1)
		}
		c.Free()
		perCell := (sizes[1]-sizes[0])/8 - 12
		if want := m.KVBytesPerCellTyped(ty.k, ty.v); perCell != want {
			t.Errorf("%s/%s: llama.cpp stores %d bytes per cell, accounting says %d", ty.k, ty.v, perCell, want)
		}
		t.Logf("K %s, V %s: %d bytes per cell", ty.k, ty.v, perCell)
	}
	if _, err := NewContext(m, ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: 1, TypeV: "q8_0", FlashAttn: 0}); err == nil {
		t.Error("a quantized V cache without flash attention was accepted")
	}
	if _, err := NewContext(m, ContextParams{NCtx: 256, NBatch: 64, NSeqMax: 1, NThreads: 1, TypeK: "q3_k"}); err == nil {
		t.Error("an unknown cache type was accepted")
	}
}
