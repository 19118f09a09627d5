package app

import (
	"fmt"
	"log/slog"
	"slices"
	"strings"

	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/runner"
)

// A modelOpener is the server's half of a speculation type that drafts with a model
// (engine.DrafterType.Model: engine.SpecDraftSimple, engine.SpecDraftMTP, whose
// proposals come from the runner): its checks of the flags and of the served model, and
// how it opens its contexts over the served ones. It hangs off the type's entry in the
// engine's registry (engine.SetModelOpener, below), the one list of speculation types,
// which also declares its --draft-p-min default and whether the served model loads its
// MTP layers; the engine cannot hold these functions typed, since they need llama and
// runner, which sit above it. The rest of a drafter is the engine's (its sessions) and
// the runner's (a runner.ModelDrafter, and a runner.Follower where its contexts mirror
// the target's). docs/speculative.md "Adding a drafter".
type modelOpener struct {
	// check validates the draft flags for it (nil: nothing of its own).
	check func(c Config) error
	// checkModel refuses a served model it cannot draft for (nil: any).
	checkModel func(c Config, model *llama.Model) error
	// assistant reports whether, with these flags, the drafter places its draft entries
	// in the target's cache (an MTP assistant: Open gives it cells; nil: never).
	assistant func(c Config) bool
	// open opens it over the served model and context (o.model, o.ctx, o.cp), pushing
	// what it holds on o.cleanups; pMin is --draft-p-min (DraftPMinFor).
	open func(o *opening, pMin float64) (*draftModel, error)
}

// The server's half of each model type, registered once on its registry entry.
func init() {
	engine.SetModelOpener(engine.SpecDraftSimple, &modelOpener{check: checkDraftSimple, open: openDraft})
	engine.SetModelOpener(engine.SpecDraftMTP, &modelOpener{checkModel: checkMTP, open: openMTP,
		assistant: func(c Config) bool { return c.ModelDraft != "" }})
}

// DraftPMinFor is --draft-p-min as given, or the drafter's default when it was not (-1):
// the registry's (engine.ModelDraft.DraftPMin), engine.DefaultDraftPMin for a type that
// declares none.
func (c Config) DraftPMinFor(typ string) float64 {
	if c.DraftPMin >= 0 {
		return c.DraftPMin
	}
	if d, ok := engine.LookupDrafter(typ); ok && d.Model != nil {
		return d.Model.DraftPMin
	}
	return engine.DefaultDraftPMin
}

// specPlan is --spec-type and the draft flags, read once (Config.specPlan): the
// drafters the server runs, in order, and the one of them with a model of its own.
type specPlan struct {
	types []string
	// model is the type that drafts with a model (its registry entry; "" Name: none),
	// and open the server's half of it.
	model engine.DrafterType
	open  *modelOpener
}

// mtpLayers reports whether the served model is loaded with its MTP layers.
func (p specPlan) mtpLayers() bool { return p.model.Model != nil && p.model.Model.MTPLayers }

// assistant reports whether the drafter is an MTP assistant (--model-draft with
// draft-mtp): it places its draft entries in the target's cache (Open gives it cells).
func (p specPlan) assistant(c Config) bool {
	return p.open != nil && p.open.assistant != nil && p.open.assistant(c)
}

// specPlan parses --spec-type, draft-simple alone when only --model-draft is given (as
// llama-server drafts with -md and no --spec-type), and checks the draft flags against it.
func (c Config) specPlan() (specPlan, error) {
	types, err := engine.ParseSpecTypes(c.SpecType)
	if err != nil {
		return specPlan{}, fmt.Errorf("--spec-type: %v", err)
	}
	if c.ModelDraft != "" && len(types) == 0 {
		types = []string{engine.SpecDraftSimple}
	}
	p := specPlan{types: types}
	var names []string
	for _, d := range engine.Drafters() {
		if d.Model != nil && slices.Contains(types, d.Name) {
			names = append(names, d.Name)
			if p.open == nil {
				op, ok := d.Model.Opener().(*modelOpener)
				if !ok {
					return specPlan{}, fmt.Errorf("--spec-type %s: this server cannot open it (no opener registered)", d.Name)
				}
				p.model, p.open = d, op
			}
		}
	}
	if len(names) > 1 {
		return specPlan{}, fmt.Errorf("--spec-type: %s cannot both run (one drafter per server); pick one", strings.Join(names, " and "))
	}
	if p.open != nil && p.open.check != nil {
		if err := p.open.check(c); err != nil {
			return specPlan{}, err
		}
	}
	switch {
	case p.open == nil && c.ModelDraft != "":
		return specPlan{}, fmt.Errorf("--model-draft is only used by --spec-type %s, or by %s for a model whose MTP drafter is a file of its own (a Gemma 4 assistant) (got %q)", engine.SpecDraftSimple, engine.SpecDraftMTP, c.SpecType)
	case c.CtxSizeDraft < 0:
		return specPlan{}, fmt.Errorf("--ctx-size-draft must be 0 (the target's --ctx-size) or positive, got %d", c.CtxSizeDraft)
	case !(c.DraftPMin >= 0 && c.DraftPMin <= 1) && c.DraftPMin != -1:
		return specPlan{}, fmt.Errorf("--draft-p-min must be in 0..1 (or -1: the drafter's default), got %v", c.DraftPMin)
	}
	return p, nil
}

// checkDraftSimple: draft-simple drafts with --model-draft.
func checkDraftSimple(c Config) error {
	if c.ModelDraft == "" {
		return fmt.Errorf("--spec-type %s needs a draft model: --model-draft PATH", engine.SpecDraftSimple)
	}
	return nil
}

// draftModel is the drafter open beside the served model: the runner's drafter over its
// contexts (which Open's cleanups free) and what it adds to each target cell's bytes.
type draftModel struct {
	drafter runner.ModelDrafter
	// bytesPerCell is what one target cell costs beside its own KV when the drafter
	// follows it (an MTP head: the MTP context's KV of one cell and the hidden-state row
	// kept for it, n_embd float32s, RAM). Added to the pools' and sessions' KV bytes.
	bytesPerCell int64
}

// openMTP gives the served model's MTP head its own context over the served context
// (the target's parameters: as many cells and sequence ids, the same batch), with NextN
// rows turned on in both (the target's for every batch entry), and the drafter that
// mirrors the target into it (runner.MTP). With --model-draft the head is that file, an
// MTP assistant (openAssistant), loaded with the served model's placement.
func openMTP(o *opening, pMin float64) (*draftModel, error) {
	cfg, model, tgt, tp, draftMax, log := o.cfg, o.model, o.ctx, o.cp, o.ecfg.Spec.DraftMax, o.log
	if cfg.ModelDraft != "" {
		return openAssistant(o, pMin)
	}
	// As many cells as the target, which it mirrors, and room for every sequence's
	// drafts beside them (one block's KV: small). A sliding-window model's SWA cache is
	// full-size here too, as the target's (runner.Policy.Params): the MTP context keeps
	// the target's SWA shadows (runner.MTP), which hold every position.
	mp := llama.ContextParams{NCtx: tp.NCtx + tp.NSeqMax*max(draftMax, 1), NBatch: tp.NBatch, NUBatch: tp.NUBatch, NSeqMax: tp.NSeqMax, NThreads: tp.NThreads,
		KVUnified: true, FlashAttn: tp.FlashAttn, AttnKernel: tp.AttnKernel, SWAFull: tp.SWAFull, MTPTarget: tgt}
	ctx, err := llama.NewContext(model, mp)
	if err != nil {
		return nil, fmt.Errorf("--spec-type %s: %w", engine.SpecDraftMTP, err)
	}
	o.cleanups.push(ctx.Free)
	m, err := newMTP(model, tgt, ctx, pMin, log)
	if err != nil {
		return nil, err
	}
	// A model with several NextN blocks (MiMo-V2, Step-3.5) chains them, one per draft
	// step: each further block gets a context of its own (runner.MTP.ChainHeads says why).
	kv := ctx.MemoryBytes()
	for i := 1; i < model.NLayerNextN(); i++ {
		c, err := llama.NewContext(model, mp)
		if err == nil {
			o.cleanups.push(c.Free)
			err = c.SetNextNLayer(i)
			c.SetEmbeddingsNextN(true, true)
		}
		if err == nil {
			err = m.ChainHeads(c)
		}
		if err != nil {
			return nil, fmt.Errorf("--spec-type %s: MTP block %d: %w", engine.SpecDraftMTP, i, err)
		}
		kv += c.MemoryBytes()
	}
	d := &draftModel{drafter: m}
	d.bytesPerCell = (kv+int64(mp.NCtx)-1)/int64(mp.NCtx) + 4*int64(model.NEmbdOut())
	if log != nil {
		log.Info("MTP drafting", "n_layer_nextn", model.NLayerNextN(), "draft_max", draftMax, "p_min", pMin,
			"mtp_kv_bytes", kv, "mtp_row_bytes_per_cell", 4*model.NEmbdOut(), "mtp_bytes_per_cell", d.bytesPerCell)
	}
	return d, nil
}

// newMTP turns the NextN rows on (the target's for every batch entry, the MTP context's
// for those with logits) and gives the drafter over the two. (On failure Open fails and
// its cleanups free both contexts.)
func newMTP(model *llama.Model, tgt, ctx *llama.Context, pMin float64, log *slog.Logger) (*runner.MTP, error) {
	tgt.SetEmbeddingsNextN(true, false)
	ctx.SetEmbeddingsNextN(true, true)
	return runner.NewMTP(model, tgt, ctx, pMin, log)
}

// openAssistant loads --model-draft, an MTP assistant for the served model (Gemma 4's:
// llama.Model.IsAssistant), and gives it a context over the served context, whose cells
// it reads (llama.cpp shares them: it keeps none, so it costs no memory per cell), with
// the drafter (runner.MTP, which then mirrors nothing). As llama-server runs one:
// --spec-type draft-mtp --model-draft ASSISTANT, and loaded as llama-server loads it, with
// the served model's placement (its layers read the target's KV where it lives; a
// draft-simple model, which has its own, stays on the CPU). On a GPU: untested.
func openAssistant(o *opening, pMin float64) (*draftModel, error) {
	cfg, model, tgt, tp, draftMax, log := o.cfg, o.model, o.ctx, o.cp, o.ecfg.Spec.DraftMax, o.log
	mp := o.off.params
	mp.LoadMTP = false
	mp.MatMulKernel = llama.KernelNamed(cfg.MMKernel)
	a, err := llama.LoadModelWith(cfg.ModelDraft, mp)
	if err != nil {
		return nil, fmt.Errorf("--model-draft: %w", err)
	}
	o.cleanups.push(a.Free)
	refuse := func(err error) (*draftModel, error) {
		return nil, fmt.Errorf("--spec-type %s --model-draft %s cannot draft for %s: %w", engine.SpecDraftMTP, cfg.ModelDraft, cfg.ModelPath, err)
	}
	if !a.IsAssistant() {
		return refuse(fmt.Errorf("its architecture is %s, not an MTP assistant (gemma4-assistant); a small model of the same vocabulary drafts with --spec-type %s, and a model with MTP layers of its own needs no --model-draft",
			a.Meta("general.architecture"), engine.SpecDraftSimple))
	}
	ap := llama.ContextParams{NCtx: tp.NCtx, NBatch: tp.NBatch, NUBatch: tp.NUBatch, NSeqMax: tp.NSeqMax, NThreads: tp.NThreads,
		KVUnified: true, FlashAttn: tp.FlashAttn, AttnKernel: tp.AttnKernel, SWAFull: tp.SWAFull, MTPTarget: tgt}
	ctx, err := llama.NewContext(a, ap)
	if err != nil {
		return refuse(err)
	}
	o.cleanups.push(ctx.Free)
	m, err := newMTP(model, tgt, ctx, pMin, log)
	if err != nil {
		return refuse(err)
	}
	if log != nil {
		log.Info("MTP drafting with an assistant", "path", cfg.ModelDraft, "desc", a.Desc(), "blocks", a.NLayerNextN(), "draft_max", draftMax, "p_min", pMin)
	}
	return &draftModel{drafter: m}, nil
}

// draftArchRefused refuses the draft-head architectures of llama.cpp that are not
// standalone models: each reads the target's hidden states or KV cache, which only
// llama.cpp's own drivers for them provide (b11434 will not even build a
// gemma4-assistant context without the target's: "Gemma4Assistant requires ctx_other",
// which reached the user as a bare "failed to create context"). As draft-simple models
// they cannot draft, so the user is told what the file is instead.
func draftArchRefused(arch string) error {
	switch arch {
	case "gemma4-assistant":
		return fmt.Errorf("it is a Gemma 4 assistant (an MTP drafter that reads the target's KV cache), not a standalone model: run it with --spec-type %s --model-draft, as llama-server does", engine.SpecDraftMTP)
	case "eagle3", "dflash":
		return fmt.Errorf("its architecture is %s, a draft head that reads the target's hidden states; PolyKV runs draft-simple models (a small model of the same vocabulary) and draft-mtp (the served model's own MTP layers), not %s heads", arch, strings.ToUpper(arch))
	}
	return nil
}

// checkMTP refuses draft-mtp on a model without MTP layers, with the reason.
func checkMTP(cfg Config, model *llama.Model) error {
	if cfg.ModelDraft != "" {
		// The drafter is that file, an MTP assistant (openAssistant checks it).
		if model.NLayerNextN() > 0 {
			return fmt.Errorf("--spec-type %s: %s has MTP layers of its own, which draft; --model-draft is for a model whose MTP drafter is a separate assistant (Gemma 4)", engine.SpecDraftMTP, cfg.ModelPath)
		}
		return nil
	}
	if model.NLayerNextN() == 0 {
		if model.Meta("general.architecture") == "gemma4" {
			// Gemma 4's MTP head ships as a separate gemma4-assistant model.
			return fmt.Errorf("--spec-type %s: %s has no MTP (NextN) layers: Gemma 4's MTP drafter is a separate assistant model (gemma-4-*-assistant); give it with --model-draft", engine.SpecDraftMTP, cfg.ModelPath)
		}
		return fmt.Errorf("--spec-type %s: %s has no MTP (NextN) layers (GGUF nextn_predict_layers is 0); use ngram-simple, ngram-mod or a draft model", engine.SpecDraftMTP, cfg.ModelPath)
	}
	if !model.MTPLoaded() {
		return fmt.Errorf("--spec-type %s: %s declares %d MTP layers but its file has no MTP weights", engine.SpecDraftMTP, cfg.ModelPath, model.NLayerNextN())
	}
	return nil
}

// openDraft loads --model-draft on the CPU and gives it its own context, shaped as the
// target's (batch, threads, flash attention, as many sequence ids) with --ctx-size-draft
// cells (the target's count by default: a draft sequence holds a session's whole
// context, borrowed pool tokens included). A model whose vocabulary differs from the
// target's, or one with recurrent state (a draft sequence is cut back to the accepted
// tokens every step), is refused with the reason.
func openDraft(o *opening, pMin float64) (*draftModel, error) {
	cfg, target, tp, log := o.cfg, o.model, o.cp, o.log
	// The draft model and its context use the kernels the served ones use (--mm-kernel,
	// --fa-kernel): the choice is per model and per context, not process-wide.
	m, err := llama.LoadModelWith(cfg.ModelDraft, llama.ModelParams{MatMulKernel: llama.KernelNamed(cfg.MMKernel)})
	if err != nil {
		return nil, fmt.Errorf("--model-draft: %w", err)
	}
	o.cleanups.push(m.Free)
	refuse := func(err error) (*draftModel, error) {
		return nil, fmt.Errorf("--model-draft %s cannot draft for %s: %w", cfg.ModelDraft, cfg.ModelPath, err)
	}
	if err := draftArchRefused(m.Meta("general.architecture")); err != nil {
		return refuse(err)
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
	o.cleanups.push(ctx.Free)
	if log != nil {
		log.Info("draft model", "path", cfg.ModelDraft, "desc", m.Desc(), "n_ctx", dp.NCtx, "p_min", pMin)
	}
	return &draftModel{drafter: runner.NewDrafter(target, m, ctx, pMin, log)}, nil
}
