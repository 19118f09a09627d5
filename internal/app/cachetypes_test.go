package app

import (
	"fmt"
	"slices"
	"testing"

	"github.com/polykv/polykv/internal/api/wire"
	"github.com/polykv/polykv/internal/llama"
)

// TestCacheTypesPooledMatchesUnpooled: with a quantized KV cache a pooled request (root
// and branch child) still gives the fully prefilled greedy tokens, and pool KV bytes are
// counted with the quantized cell size.
func TestCacheTypesPooledMatchesUnpooled(t *testing.T) {
	for _, ct := range []string{"q8_0", "q4_0"} {
		t.Run(ct, func(t *testing.T) {
			a, base := startServer(t, Config{NCtx: 512, Parallel: 2, MaxPools: 2, CacheTypeK: ct, CacheTypeV: ct})
			rootToks := tokenize(t, a, longSystem(t, a, 60))
			root := createPool(t, base, map[string]any{"tokens": rootToks})
			id := num(root["pool_id"])
			d := len(rootToks) / 2
			branchToks := append(slices.Clone(rootToks[:d]), suffixTokens(t, a, " Only the calculator tool.")...)
			code, out := forkPool(t, base, id, d, map[string]any{"tokens": branchToks})
			if code != 201 {
				t.Fatalf("branch: %d %v", code, out)
			}
			branch := num(out["pool_id"])
			question := suffixTokens(t, a, " Which tool first? Answer:")
			for _, c := range []struct {
				pool   int
				prefix []int32
			}{{id, rootToks}, {branch, branchToks}} {
				prompt := append(slices.Clone(c.prefix), question...)
				want, _ := greedyTokens(t, base, prompt, 0, 8)
				got, cacheN := greedyTokens(t, base, prompt, c.pool, 8)
				if cacheN != len(c.prefix) || !slices.Equal(got, want) {
					t.Fatalf("pool %d: cache_n %d (want %d), pooled %v, unpooled %v", c.pool, cacheN, len(c.prefix), got, want)
				}
			}
			bpc := a.Model.KVBytesPerCellTyped(llama.CacheType(ct), llama.CacheType(ct))
			if bpc >= a.Model.KVBytesPerCell() {
				t.Fatalf("%s cell %d B is not smaller than f16's %d B", ct, bpc, a.Model.KVBytesPerCell())
			}
			var info wire.PoolInfo
			get(t, fmt.Sprintf("%s/polykv/pools/%d", base, id), &info)
			if info.OwnKVBytes != int64(len(rootToks))*bpc {
				t.Fatalf("root own_kv_bytes %d, want %d cells × %d B", info.OwnKVBytes, len(rootToks), bpc)
			}
		})
	}
	if _, err := Open(withDefaults(Config{ModelPath: modelPath(t), CacheTypeV: "q8_0", FlashAttn: "off"}), nil); err == nil {
		t.Fatal("a quantized V cache with --flash-attn off was accepted")
	}
	if _, err := Open(withDefaults(Config{ModelPath: modelPath(t), CacheTypeK: "q2"}), nil); err == nil {
		t.Fatal("--cache-type-k q2 was accepted")
	}
}
