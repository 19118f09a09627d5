package bench

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
	// decode, when positive, adds a decode row (tgN) after each model and cache type's
	// prefill rows: one sequence, depth tokens of the test prompt prefilled untimed
	// (llama-bench gets the same as -d), then decode single-token steps timed,
	// alternating like prefill (llama-bench -p 0 -n decode -d depth).
	decode, depth int
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
	if p.decode < 0 || p.depth < 1 {
		return fmt.Errorf("bench: bad --prefill-decode %d or --prefill-decode-depth %d", p.decode, p.depth)
	}
	// With PolyKV's CPU kernels (flash attention, Q4_1/K-quant matrices), every row also
	// times ggml's own kernels, alternating in the same run, so the kernels' gain is a
	// ratio from one run too.
	ours := (cfg.FlashAttn != "off" && cfg.FAKernel != "ggml") || cfg.MMKernel != "ggml"
	fmt.Printf("Prefill (one sequence, --batch %d, --ubatch %d, %d threads, flash-attn %s, fa-kernel %s, mm-kernel %s), best of %d:\n",
		cfg.NBatch, cfg.NUBatch, cfg.Threads, cfg.FlashAttn, cfg.FAKernel, cfg.MMKernel, reps)
	if p.decode > 0 {
		fmt.Printf("tg%d rows: decode, %d single-token steps after an untimed %d-token prompt\n", p.decode, p.decode, p.depth)
	}
	fmt.Println()
	if p.baseline != "" {
		fmt.Printf("baseline: %s\n\n", p.baseline)
	}
	fmt.Print("model                                 cache    tokens   polykv tok/s")
	if ours {
		fmt.Print("    ggml kernels tok/s")
	}
	if p.baseline != "" {
		fmt.Print("  llama-bench tok/s  polykv/llama-bench")
	}
	fmt.Println()
	for _, path := range models {
		model, err := llama.LoadModel(path)
		if err != nil {
			return err
		}
		err = p.model(model, path, cfg, reps, lens, ours)
		model.Free()
		if err != nil {
			return err
		}
	}
	return nil
}

// model prints the rows of one loaded model: per cache type, the prefill rows, then
// the decode row when p.decode is set.
func (p prefillBench) model(model *llama.Model, path string, cfg app.Config, reps int, lens []int, ours bool) error {
	toks, err := model.Tokenize(strings.Repeat("The quick brown fox jumps over the lazy dog while the engineer measures prefill speed. ", 400), true, false)
	if err != nil {
		return err
	}
	if p.decode > 0 && p.depth+p.decode > len(toks) {
		return fmt.Errorf("bench: --prefill-decode %d exceeds the %d tokens of the test prompt after its first %d", p.decode, len(toks)-p.depth, p.depth)
	}
	name := strings.TrimSuffix(path[strings.LastIndex(path, "/")+1:], ".gguf")
	for _, ct := range strings.Split(p.types, ",") {
		ct = strings.TrimSpace(ct)
		withStock := ours
		for _, n := range lens {
			if n > len(toks) {
				return fmt.Errorf("bench: prefill length %d exceeds the %d-token test prompt", n, len(toks))
			}
			r, err := alternate(model, cfg, reps, withStock,
				func(attn llama.Kernel) (float64, error) {
					return prefillOnce(model, cfg, attn, llama.CacheType(ct), toks[:n])
				},
				p.llamaBench(path, cfg, ct, n, 0, 0))
			if err != nil {
				return fmt.Errorf("prefill %s %s %d: %w", path, ct, n, err)
			}
			r.print(name, ct, strconv.Itoa(n), ours, withStock, p.baseline != "")
		}
		if p.decode > 0 {
			prompt, steps := toks[:p.depth], toks[p.depth:p.depth+p.decode]
			r, err := alternate(model, cfg, reps, withStock,
				func(attn llama.Kernel) (float64, error) {
					return decodeOnce(model, cfg, attn, llama.CacheType(ct), prompt, steps)
				},
				p.llamaBench(path, cfg, ct, 0, p.decode, p.depth))
			if err != nil {
				return fmt.Errorf("decode %s %s tg%d: %w", path, ct, p.decode, err)
			}
			r.print(name, ct, fmt.Sprintf("tg%d", p.decode), ours, withStock, p.baseline != "")
		}
	}
	return nil
}

// llamaBench returns the baseline measurement of a row (see llamaBench), or nil
// without --prefill-baseline.
func (p prefillBench) llamaBench(path string, cfg app.Config, ct string, prompt, gen, depth int) func() (float64, error) {
	if p.baseline == "" {
		return nil
	}
	return func() (float64, error) { return llamaBench(p.baseline, path, cfg, ct, prompt, gen, depth) }
}

// benchRow is one table row: the best tokens per second with the configured kernels,
// with ggml's own kernels and llama-bench's (0 where not measured).
type benchRow struct{ ours, stock, base float64 }

// alternate measures one row reps times. Each repetition runs run with the configured
// kernels, then run with ggml's kernels when stock is set, then base when it is not nil,
// so the three alternate on one machine state; it keeps the best of each.
func alternate(model *llama.Model, cfg app.Config, reps int, stock bool, run func(attn llama.Kernel) (float64, error), base func() (float64, error)) (benchRow, error) {
	var r benchRow
	for range reps {
		attn, err := useKernels(model, cfg, true)
		if err != nil {
			return r, err
		}
		tps, err := run(attn)
		if err != nil {
			return r, err
		}
		r.ours = max(r.ours, tps)
		if stock {
			attn, err := useKernels(model, cfg, false)
			if err != nil {
				return r, err
			}
			tps, err := run(attn)
			if err != nil {
				return r, fmt.Errorf("ggml kernels: %w", err)
			}
			r.stock = max(r.stock, tps)
		}
		if base != nil {
			tps, err := base()
			if err != nil {
				return r, err
			}
			r.base = max(r.base, tps)
		}
	}
	return r, nil
}

// useKernels selects the configured CPU kernels (configured true) or ggml's own for both
// flash attention and Q4_1/K-quant matrices: the model's matrix kernel is set, and the
// attention kernel the run's contexts are to use is returned.
func useKernels(model *llama.Model, cfg app.Config, configured bool) (attn llama.Kernel, err error) {
	attn, mm := llama.KernelGGML, llama.KernelGGML
	if configured {
		attn, mm = llama.KernelNamed(cfg.FAKernel), llama.KernelNamed(cfg.MMKernel)
	}
	return attn, model.SetMatMulKernel(mm)
}

// print writes the row under the header run printed: ours names that header's ggml
// kernel column (stock: this row has a value in it), baseline its llama-bench columns.
func (r benchRow) print(name, ct, tokens string, ours, stock, baseline bool) {
	fmt.Printf("%-37s %-7s %7s  %13.1f", name, ct, tokens, r.ours)
	switch {
	case stock:
		fmt.Printf("  %20.1f", r.stock)
	case ours:
		fmt.Printf("  %20s", "-")
	}
	if baseline {
		fmt.Printf("  %17.1f  %18.3f", r.base, r.ours/r.base)
	}
	fmt.Println()
}

// benchContext creates the one-sequence context prefillOnce and decodeOnce time:
// flash attention, threads and batch sizes from cfg, the attention kernel attn, K and V
// of cache type ct, nCtx cells.
func benchContext(model *llama.Model, cfg app.Config, attn llama.Kernel, ct llama.CacheType, nCtx int) (*llama.Context, error) {
	return llama.NewContext(model, llama.ContextParams{FlashAttn: app.FlashAttn(cfg.FlashAttn), NCtx: nCtx,
		NBatch: cfg.NBatch, NUBatch: cfg.NUBatch, NSeqMax: 1, NThreads: cfg.Threads, KVUnified: true, TypeK: ct, TypeV: ct,
		SWAFull: model.NSWA() > 0, AttnKernel: attn})
}

// feed decodes toks as sequence 0 from position 0 in --batch chunks, with logits for
// the last token only.
func feed(ctx *llama.Context, toks []llama.Token) error {
	for i := 0; i < len(toks); {
		ctx.BatchClear()
		for ; i < len(toks) && ctx.BatchLen() < ctx.BatchCap(); i++ {
			if _, err := ctx.BatchAdd(toks[i], i, 0, i == len(toks)-1); err != nil {
				return err
			}
		}
		if err := ctx.Decode(); err != nil {
			return err
		}
	}
	return nil
}

// prefillOnce times the prefill of toks in a fresh context and returns tokens per second.
func prefillOnce(model *llama.Model, cfg app.Config, attn llama.Kernel, ct llama.CacheType, toks []llama.Token) (float64, error) {
	ctx, err := benchContext(model, cfg, attn, ct, len(toks)+16)
	if err != nil {
		return 0, err
	}
	defer ctx.Free()
	start := time.Now()
	if err := feed(ctx, toks); err != nil {
		return 0, err
	}
	return float64(len(toks)) / time.Since(start).Seconds(), nil
}

// decodeOnce prefills prompt in a fresh context (untimed), then times one decode step
// per token of steps, each a batch of that one token with logits for it, as greedy
// generation of one sequence runs (the tokens are given rather than sampled, as
// llama-bench's are), and returns steps per second.
func decodeOnce(model *llama.Model, cfg app.Config, attn llama.Kernel, ct llama.CacheType, prompt, steps []llama.Token) (float64, error) {
	ctx, err := benchContext(model, cfg, attn, ct, len(prompt)+len(steps))
	if err != nil {
		return 0, err
	}
	defer ctx.Free()
	if err := feed(ctx, prompt); err != nil {
		return 0, err
	}
	start := time.Now()
	for i, t := range steps {
		ctx.BatchClear()
		if _, err := ctx.BatchAdd(t, len(prompt)+i, 0, true); err != nil {
			return 0, err
		}
		if err := ctx.Decode(); err != nil {
			return 0, err
		}
	}
	return float64(len(steps)) / time.Since(start).Seconds(), nil
}

// llamaBench runs llama-bench once (one repetition after its own warm-up) with the
// settings prefillOnce and decodeOnce use: prompt tokens of prefill, or gen decode steps
// after depth untimed prompt tokens (-d, passed only when positive). It returns
// llama-bench's tokens per second.
func llamaBench(bin, model string, cfg app.Config, ct string, prompt, gen, depth int) (float64, error) {
	args := []string{"-m", model, "-p", strconv.Itoa(prompt), "-n", strconv.Itoa(gen), "-t", strconv.Itoa(cfg.Threads),
		"-b", strconv.Itoa(cfg.NBatch), "-ub", strconv.Itoa(cfg.NUBatch), "-fa", cfg.FlashAttn,
		"-ctk", ct, "-ctv", ct, "-r", "1", "-o", "json"}
	if depth > 0 {
		args = append(args, "-d", strconv.Itoa(depth))
	}
	out, err := exec.Command(bin, args...).Output()
	if err != nil {
		return 0, fmt.Errorf("bench: %s %s: %w", bin, strings.Join(args, " "), err)
	}
	var rows []struct {
		NPrompt int     `json:"n_prompt"`
		NGen    int     `json:"n_gen"`
		NDepth  int     `json:"n_depth"`
		AvgTS   float64 `json:"avg_ts"`
	}
	if err := json.Unmarshal(out, &rows); err != nil || len(rows) != 1 ||
		rows[0].NPrompt != prompt || rows[0].NGen != gen || rows[0].NDepth != depth {
		return 0, fmt.Errorf("bench: unexpected llama-bench output (%v): %.200s", err, out)
	}
	return rows[0].AvgTS, nil
}
