package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
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
	// baseline is a llama-bench binary built from llama.cpp (optional): each
	// measurement then alternates with llama-bench's on the same GGUF, threads, batch
	// sizes, flash attention and cache type, so the ratio comes from one run on one
	// machine state. llama-bench measures the same llama_decode path llama-server's
	// prompt processing takes, without HTTP in between (as ours here has none).
	baseline string
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
	// With PolyKV's flash-attention kernel, f16 rows also time ggml's own kernel,
	// alternating in the same run, so the kernel's gain is a ratio from one run too.
	ours := cfg.FlashAttn != "off" && cfg.FAKernel != "ggml"
	fmt.Printf("Prefill (one sequence, --batch %d, --ubatch %d, %d threads, flash-attn %s, fa-kernel %s), best of %d:\n\n",
		cfg.NBatch, cfg.NUBatch, cfg.Threads, cfg.FlashAttn, cfg.FAKernel, reps)
	if p.baseline != "" {
		fmt.Printf("baseline: %s\n\n", p.baseline)
	}
	fmt.Print("model                                 cache    tokens  prefill tok/s")
	if ours {
		fmt.Print("  ggml FA kernel tok/s")
	}
	if p.baseline != "" {
		fmt.Print("  llama-bench tok/s  polykv/llama-bench")
	}
	fmt.Println()
	defer llama.SetFlashAttnKernel(cfg.FAKernel != "ggml")
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
				best, stock, base := 0.0, 0.0, 0.0
				withStock := ours && (ct == "f16" || ct == "")
				for range reps {
					llama.SetFlashAttnKernel(cfg.FAKernel != "ggml")
					tps, err := prefillOnce(model, cfg, llama.CacheType(ct), toks[:n])
					if err != nil {
						model.Free()
						return fmt.Errorf("prefill %s %s %d: %w", path, ct, n, err)
					}
					best = max(best, tps)
					if withStock {
						llama.SetFlashAttnKernel(false)
						tps, err := prefillOnce(model, cfg, llama.CacheType(ct), toks[:n])
						if err != nil {
							model.Free()
							return fmt.Errorf("prefill %s %s %d (ggml kernel): %w", path, ct, n, err)
						}
						stock = max(stock, tps)
					}
					if p.baseline != "" {
						b, err := llamaBench(p.baseline, path, cfg, ct, n)
						if err != nil {
							model.Free()
							return err
						}
						base = max(base, b)
					}
				}
				name := strings.TrimSuffix(path[strings.LastIndex(path, "/")+1:], ".gguf")
				fmt.Printf("%-37s %-7s %7d  %13.1f", name, ct, n, best)
				switch {
				case withStock:
					fmt.Printf("  %20.1f", stock)
				case ours:
					fmt.Printf("  %20s", "-")
				}
				if p.baseline != "" {
					fmt.Printf("  %17.1f  %18.3f", base, best/base)
				}
				fmt.Println()
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

// llamaBench runs llama-bench once (one repetition after its own warm-up) with the
// settings prefillOnce uses and returns its prompt tokens per second.
func llamaBench(bin, model string, cfg app.Config, ct string, n int) (float64, error) {
	args := []string{"-m", model, "-p", strconv.Itoa(n), "-n", "0", "-t", strconv.Itoa(cfg.Threads),
		"-b", strconv.Itoa(cfg.NBatch), "-ub", strconv.Itoa(cfg.NUBatch), "-fa", cfg.FlashAttn,
		"-ctk", ct, "-ctv", ct, "-r", "1", "-o", "json"}
	out, err := exec.Command(bin, args...).Output()
	if err != nil {
		return 0, fmt.Errorf("bench: %s %s: %w", bin, strings.Join(args, " "), err)
	}
	var rows []struct {
		NPrompt int     `json:"n_prompt"`
		AvgTS   float64 `json:"avg_ts"`
	}
	if err := json.Unmarshal(out, &rows); err != nil || len(rows) != 1 || rows[0].NPrompt != n {
		return 0, fmt.Errorf("bench: unexpected llama-bench output (%v): %.200s", err, out)
	}
	return rows[0].AvgTS, nil
}
