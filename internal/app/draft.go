package app

import (
	"fmt"
	"log/slog"
	"slices"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/runner"
)

// DefaultDraftPMin is --draft-p-min's default, llama-server's (common_params_speculative
// p_min): a session's draft stops at the first token the draft model gives less.
const DefaultDraftPMin = 0.75

// specTypes is the drafters the server runs: --spec-type's, or draft-simple alone when
// only --model-draft is given (as llama-server drafts with -md and no --spec-type).
func (c Config) specTypes() []string {
	types, _ := engine.ParseSpecTypes(c.SpecType)
	if c.ModelDraft != "" && len(types) == 0 {
		types = []string{engine.SpecDraftSimple}
	}
	return types
}

// checkDraft validates the draft model's flags against --spec-type.
func (c Config) checkDraft() error {
	types := c.specTypes()
	has := slices.Contains(types, engine.SpecDraftSimple)
	switch {
	case has && c.ModelDraft == "":
		return fmt.Errorf("--spec-type %s needs a draft model: --model-draft PATH", engine.SpecDraftSimple)
	case !has && c.ModelDraft != "":
		return fmt.Errorf("--model-draft is only used by --spec-type %s (got %q)", engine.SpecDraftSimple, c.SpecType)
	case c.CtxSizeDraft < 0:
		return fmt.Errorf("--ctx-size-draft must be 0 (the target's --ctx-size) or positive, got %d", c.CtxSizeDraft)
	case !(c.DraftPMin >= 0 && c.DraftPMin <= 1):
		return fmt.Errorf("--draft-p-min must be in 0..1, got %v", c.DraftPMin)
	}
	return nil
}

// draftModel is the draft model, its context and the drafter over them.
type draftModel struct {
	model   *llama.Model
	ctx     *llama.Context
	drafter *runner.Drafter
}

func (d *draftModel) free() {
	if d == nil {
		return
	}
	d.ctx.Free()
	d.model.Free()
}

// openDraft loads --model-draft on the CPU and gives it its own context, shaped as the
// target's (tp: batch, threads, flash attention, as many sequence ids) with
// --ctx-size-draft cells (the target's count by default: a draft sequence holds a
// session's whole context, borrowed pool tokens included). A model whose vocabulary
// differs from the target's, or one with recurrent state (a draft sequence is cut back
// to the accepted tokens every step), is refused with the reason.
func openDraft(cfg Config, target *llama.Model, tp llama.ContextParams, log *slog.Logger) (*draftModel, error) {
	// The draft model and its context use the kernels the served ones use (--mm-kernel,
	// --fa-kernel): the choice is per model and per context, not process-wide.
	m, err := llama.LoadModelWith(cfg.ModelDraft, llama.ModelParams{MatMulKernel: llama.KernelNamed(cfg.MMKernel)})
	if err != nil {
		return nil, fmt.Errorf("--model-draft: %w", err)
	}
	refuse := func(err error) (*draftModel, error) {
		m.Free()
		return nil, fmt.Errorf("--model-draft %s cannot draft for %s: %w", cfg.ModelDraft, cfg.ModelPath, err)
	}
	if err := llama.CheckDraftVocab(target, m); err != nil {
		return refuse(err)
	}
	if m.IsRecurrent() || m.IsHybrid() {
		return refuse(fmt.Errorf("it keeps recurrent state, which cannot be cut back past a rejected draft"))
	}
	dp := llama.ContextParams{NCtx: cfg.NCtx, NBatch: tp.NBatch, NUBatch: tp.NUBatch, NSeqMax: tp.NSeqMax,
		NThreads: tp.NThreads, KVUnified: true, FlashAttn: tp.FlashAttn, AttnKernel: tp.AttnKernel}
	if cfg.CtxSizeDraft > 0 {
		dp.NCtx = cfg.CtxSizeDraft
	}
	ctx, err := llama.NewContext(m, dp)
	if err != nil {
		return refuse(err)
	}
	if log != nil {
		log.Info("draft model", "path", cfg.ModelDraft, "desc", m.Desc(), "n_ctx", dp.NCtx, "p_min", cfg.DraftPMin)
	}
	return &draftModel{model: m, ctx: ctx, drafter: runner.NewDrafter(target, m, ctx, cfg.DraftPMin, log)}, nil
}
