// Package runner adapts the llama binding to the engine's Backend and Vocab interfaces.
package runner

import (
	"fmt"
	"log/slog"
	"math"

	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
)

// Backend drives one llama.cpp context. Only the engine goroutine may call it.
type Backend struct {
	ctx      *llama.Context
	model    *llama.Model
	samplers map[engine.TaskID]*sampler
	log      *slog.Logger
}

type sampler struct {
	s        *llama.Sampler
	logprobs bool
}

var _ engine.Backend = (*Backend)(nil)

// NewBackend wraps ctx (a context of model).
func NewBackend(model *llama.Model, ctx *llama.Context, log *slog.Logger) *Backend {
	if log == nil {
		log = slog.Default()
	}
	return &Backend{ctx: ctx, model: model, samplers: map[engine.TaskID]*sampler{}, log: log}
}

// Decode implements engine.Backend.
func (b *Backend) Decode(batch []engine.BatchEntry) ([]engine.Sampled, error) {
	b.ctx.BatchClear()
	for _, e := range batch {
		if _, err := b.ctx.BatchAdd(e.Token, e.Pos, e.Seq, e.Sample); err != nil {
			return nil, err
		}
	}
	if err := b.ctx.Decode(); err != nil {
		return nil, err
	}
	var out []engine.Sampled
	for i, e := range batch {
		if !e.Sample {
			continue
		}
		smp, ok := b.samplers[e.Task]
		if !ok {
			return nil, fmt.Errorf("no sampler for task %d", e.Task)
		}
		tok := smp.s.Sample(b.ctx, i)
		s := engine.Sampled{Token: tok}
		if smp.logprobs {
			s.Logprob = logSoftmaxAt(b.ctx.Logits(i), tok)
		}
		out = append(out, s)
	}
	return out, nil
}

// logSoftmaxAt is log p(tok) under the raw (pre-sampler) logits.
func logSoftmaxAt(logits []float32, tok llama.Token) float32 {
	if int(tok) >= len(logits) || tok < 0 {
		return float32(math.Inf(-1))
	}
	mx := logits[0]
	for _, l := range logits {
		mx = max(mx, l)
	}
	var sum float64
	for _, l := range logits {
		sum += math.Exp(float64(l - mx))
	}
	return float32(float64(logits[tok]-mx) - math.Log(sum))
}

// SeqRm implements engine.Backend.
func (b *Backend) SeqRm(seq, p0, p1 int) bool { return b.ctx.SeqRm(seq, p0, p1) }

// SeqCp implements engine.Backend.
func (b *Backend) SeqCp(src, dst, p0, p1 int) { b.ctx.SeqCp(src, dst, p0, p1) }

// NewSampler implements engine.Backend.
func (b *Backend) NewSampler(task engine.TaskID, p engine.SamplingParams, logprobs bool, history []engine.Token) {
	s, err := llama.NewSampler(b.model, llama.SamplerParams(p))
	if err != nil {
		// The API checks grammars before submitting, so this is a bug; sample freely
		// rather than fail a request mid-flight.
		b.log.Error("sampler grammar rejected; sampling unconstrained", "task", task, "err", err)
		p.Grammar = ""
		s, _ = llama.NewSampler(b.model, llama.SamplerParams(p))
	}
	// Prompt tokens prime the penalties, never a grammar (it constrains output only).
	if p.Grammar == "" && (p.RepeatPenalty != 0 && p.RepeatPenalty != 1 || p.FrequencyPenalty != 0 || p.PresencePenalty != 0) {
		for _, t := range history {
			s.Accept(t)
		}
	}
	b.samplers[task] = &sampler{s: s, logprobs: logprobs}
}

// FreeSampler implements engine.Backend.
func (b *Backend) FreeSampler(task engine.TaskID) {
	if s, ok := b.samplers[task]; ok {
		s.s.Free()
		delete(b.samplers, task)
	}
}

// Vocab exposes the model's tokenizer to the engine.
type Vocab struct{ M *llama.Model }

// Piece implements engine.Vocab.
func (v Vocab) Piece(tok engine.Token) []byte { return v.M.TokenPiece(tok, false) }

// IsEOG implements engine.Vocab.
func (v Vocab) IsEOG(tok engine.Token) bool { return v.M.IsEOG(tok) }

// NewChatRenderer renders with source (the model's Jinja template or a command-line
// override) the way transformers does. There is no llama_chat_apply_template fallback:
// it would silently drop tools and tool turns, so an unusable template is a 400.
func NewChatRenderer(m *llama.Model, source string) *chat.Renderer {
	return chat.NewRenderer(source, string(m.TokenPiece(m.BOS(), true)), string(m.TokenPiece(m.EOS(), true)))
}

// ProbeFits reports whether n more cells can be written to the cache right now, by
// decoding n placeholder tokens into the empty sequence seq and removing them again.
// It measures free cells from llama.cpp itself, independent of PolyKV's accounting;
// tests use it to check that accounting. seq must hold nothing.
func (b *Backend) ProbeFits(seq, n int, tok llama.Token) (bool, error) {
	if b.ctx.SeqPosMax(seq) >= 0 {
		return false, fmt.Errorf("probe: sequence %d is not empty", seq)
	}
	defer b.ctx.SeqRm(seq, 0, -1)
	for pos := 0; pos < n; {
		b.ctx.BatchClear()
		for ; pos < n && b.ctx.BatchLen() < b.ctx.BatchCap(); pos++ {
			if _, err := b.ctx.BatchAdd(tok, pos, seq, false); err != nil {
				return false, err
			}
		}
		if err := b.ctx.Decode(); err != nil {
			if err == llama.ErrNoKVSlot {
				return false, nil
			}
			return false, err
		}
	}
	return true, nil
}
