package runner

import (
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/engine"
)

// Each architecture's policy, without a model: a plain transformer changes nothing, a
// recurrent one runs pools at boundaries without the prefix cache, and a sliding-window
// one doubles the sequence ids, refuses what the shadows cannot protect, and the tier
// only without its anchors; a recurrent one takes one scratch sequence id more.
func TestPolicy(t *testing.T) {
	plain, recurrent := Policy{}, Policy{Recurrent: true}
	swa := Policy{SWA: 512, Anchors: true}

	c := engine.Config{PrefixCache: true}
	if plain.Configure(&c) || c.Recurrent || !c.PrefixCache {
		t.Errorf("plain model changed the engine config: %+v", c)
	}
	if !recurrent.Configure(&c) || !c.Recurrent || c.PrefixCache {
		t.Errorf("recurrent model: config %+v, want Recurrent and no prefix cache (reported)", c)
	}
	if recurrent.Configure(&c) {
		t.Error("recurrent model reported turning off a prefix cache that was already off")
	}

	if plain.ContextSeqs(20) != 21 || swa.ContextSeqs(20) != 41 || (Policy{SWA: 512}).ContextSeqs(20) != 21 {
		t.Error("context sequence ids: want n+1 (the tier's scratch sequence), 2n+1 with SWA anchors")
	}
	if err := swa.Check((engine.MaxSeqs-1)/2, 512, 512); err != nil {
		t.Errorf("SWA model at the sequence limit: %v", err)
	}
	if err := swa.Check((engine.MaxSeqs-1)/2+1, 512, 512); err == nil || !strings.Contains(err.Error(), "two sequence ids") {
		t.Errorf("SWA model over the sequence limit: %v", err)
	}
	if err := swa.Check(8, 1024, 256); err == nil || !strings.Contains(err.Error(), "--ubatch") {
		t.Errorf("SWA model with micro-batches of a batch above the window: %v", err)
	}
	if err := swa.Check(8, 512, 256); err != nil {
		t.Errorf("SWA model with a batch within the window: %v", err)
	}
	if err := plain.Check(engine.MaxSeqs-1, 1024, 256); err != nil {
		t.Errorf("plain model at the sequence limit: %v", err)
	}
	if err := plain.Check(engine.MaxSeqs, 1024, 256); err == nil || !strings.Contains(err.Error(), "one sequence id more") {
		t.Errorf("plain model over the sequence limit (no id left for the scratch sequence): %v", err)
	}

	both := Policy{SWA: 512, Anchors: true, Recurrent: true}
	if plain.TierOff() != "" || swa.TierOff() != "" || recurrent.TierOff() != "" || both.TierOff() != "" ||
		!strings.Contains((Policy{SWA: 512}).TierOff(), "sliding-window") {
		t.Errorf("tier: plain %q, swa %q, recurrent %q, both %q, swa without anchors %q",
			plain.TierOff(), swa.TierOff(), recurrent.TierOff(), both.TierOff(), (Policy{SWA: 512}).TierOff())
	}
	if recurrent.ContextSeqs(20) != 21 || recurrent.Check(engine.MaxSeqs-1, 512, 512) != nil || recurrent.Check(engine.MaxSeqs, 512, 512) == nil {
		t.Error("recurrent model: want one sequence id more than the engine's (the tier's scratch sequence), within the limit")
	}
}
