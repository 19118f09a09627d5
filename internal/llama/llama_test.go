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

// TestMemoryBytesArchs checks the byte accounting on the random-weight models of this
// year's families (make testmodels) against the memory llama.cpp allocates: 256 more
// cells of context cost 256 × the bytes per cell (a hybrid's recurrent layers add
// nothing per cell; Gemma 4's sliding-window cache is full-size, as PolyKV runs it), and
// two more sequences cost twice the recurrent state per sequence (nothing on a model
// without recurrent layers). A saved sequence carries its recurrent state too.
func TestMemoryBytesArchs(t *testing.T) {
	for _, c := range []struct {
		arch      string
		recurrent bool
	}{{"qwen35", true}, {"lfm2", true}, {"granitehybrid", true}, {"gemma4", false}, {"llama", false}} {
		t.Run(c.arch, func(t *testing.T) {
			m, err := LoadModel(testmodel.Arch(t, c.arch))
			if err != nil {
				t.Fatal(err)
			}
			defer m.Free()
			open := func(nCtx, nSeq int) *Context {
				ctx, err := NewContext(m, ContextParams{NCtx: nCtx, NBatch: 64, NSeqMax: nSeq, NThreads: 2, KVUnified: true, FlashAttn: 1, SWAFull: true})
				if err != nil {
					t.Fatal(err)
				}
				return ctx
			}
			mem := func(nCtx, nSeq int) int64 {
				ctx := open(nCtx, nSeq)
				defer ctx.Free()
				return ctx.MemoryBytes()
			}
			base := mem(256, 2)
			kv, perCell := m.KVBytesPerCell(), (mem(512, 2)-base)/256
			if kv <= 0 || perCell != kv {
				t.Errorf("256 more cells cost %d bytes each, accounting says %d", perCell, kv)
			}
			ctx := open(256, 2)
			defer ctx.Free()
			rec, perSeq := ctx.RecurrentBytesPerSeq(), (mem(256, 4)-base)/2
			if perSeq != rec || (rec > 0) != c.recurrent {
				t.Errorf("2 more sequences cost %d bytes each, accounting says %d (recurrent: %v)", perSeq, rec, c.recurrent)
			}
			ctx.BatchClear()
			for pos := range 8 {
				if _, err := ctx.BatchAdd(Token(4+pos), pos, 0, pos == 7); err != nil {
					t.Fatal(err)
				}
			}
			if err := ctx.Decode(); err != nil {
				t.Fatal(err)
			}
			if st := ctx.SeqStateSize(0); st < rec+8*kv {
				t.Errorf("saved state of 8 tokens %d bytes, less than its recurrent state %d + 8 cells of %d", st, rec, kv)
			}
			t.Logf("%s: %d KV bytes per cell, %d recurrent-state bytes per sequence", c.arch, kv, rec)
		})
	}
}
