package main

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/llama"
)

// prefillBench measures prompt processing (prefill) straight over the binding: one
// sequence, the prompt decoded in --batch chunks with logits for the last token only,
// flash attention as configured, for each model, KV cache type and prompt length.
type prefillBench struct {
	models, types, lengths string
}

func (p prefillBench) run(cfg app.Config, reps int) error {
	models := []string{cfg.ModelPath}
	if p.models != "" {
		models = nil
		for _, m := range strings.Split(p.models, ",") {
			if m = strings.TrimSpace(m); m == "" {
				continue
			}
			if _, err := os.Stat(m); err != nil {
				fmt.Printf("prefill: skipping %s (%v)\n", m, err)
				continue
			}
			models = append(models, m)
		}
	}
	var lens []int
	for _, f := range strings.Split(p.lengths, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n < 1 {
			return fmt.Errorf("bench: bad prefill length %q", f)
		}
		lens = append(lens, n)
	}
	fmt.Printf("Prefill (one sequence, --batch %d, --ubatch %d, %d threads, flash-attn %s), best of %d:\n\n",
		cfg.NBatch, cfg.NUBatch, cfg.Threads, cfg.FlashAttn, reps)
	fmt.Println("model                                 cache    tokens  prefill tok/s")
	for _, path := range models {
		model, err := llama.LoadModel(path)
		if err != nil {
			return err
		}
		toks, err := model.Tokenize(strings.Repeat("The quick brown fox jumps over the lazy dog while the engineer measures prefill speed. ", 400), true, false)
		if err != nil {
			model.Free()
			return err
		}
		for _, ct := range strings.Split(p.types, ",") {
			ct = strings.TrimSpace(ct)
			for _, n := range lens {
				if n > len(toks) {
					model.Free()
					return fmt.Errorf("bench: prefill length %d exceeds the %d-token test prompt", n, len(toks))
				}
				best := 0.0
				for range reps {
					tps, err := prefillOnce(model, cfg, llama.CacheType(ct), toks[:n])
					if err != nil {
						model.Free()
						return fmt.Errorf("prefill %s %s %d: %w", path, ct, n, err)
					}
					best = max(best, tps)
				}
				name := strings.TrimSuffix(path[strings.LastIndex(path, "/")+1:], ".gguf")
				fmt.Printf("%-37s %-7s %7d  %13.1f\n", name, ct, n, best)
			}
		}
		model.Free()
	}
	return nil
}

func prefillOnce(model *llama.Model, cfg app.Config, ct llama.CacheType, toks []llama.Token) (float64, error) {
	ctx, err := llama.NewContext(model, llama.ContextParams{FlashAttn: app.FlashAttn(cfg.FlashAttn), NCtx: len(toks) + 16,
		NBatch: cfg.NBatch, NUBatch: cfg.NUBatch, NSeqMax: 1, NThreads: cfg.Threads, KVUnified: true, TypeK: ct, TypeV: ct,
		SWAFull: model.NSWA() > 0})
	if err != nil {
		return 0, err
	}
	defer ctx.Free()
	start := time.Now()
	for i := 0; i < len(toks); {
		ctx.BatchClear()
		for ; i < len(toks) && ctx.BatchLen() < ctx.BatchCap(); i++ {
			if _, err := ctx.BatchAdd(toks[i], i, 0, i == len(toks)-1); err != nil {
				return 0, err
			}
		}
		if err := ctx.Decode(); err != nil {
			return 0, err
		}
	}
	return float64(len(toks)) / time.Since(start).Seconds(), nil
}
