// Package enginetest provides a fake engine.Backend and a byte-level vocabulary, so
// packages that drive the engine (the HTTP layer) can be tested in milliseconds without
// a model. The engine's own tests keep their richer fake (a cell-level KV model) inside
// package engine; this one only checks what the HTTP layer can get wrong: the tokens,
// texts and logprobs that reach a reply.
package enginetest

import (
	"fmt"
	"sync"

	"github.com/polykv/polykv/internal/engine"
)

// Vocabulary layout: token 0 ends generation, token 1+b is the single byte b (so any
// text tokenizes, and a multi-byte character splits into pieces that are not valid
// UTF-8 on their own, as a byte-level BPE does with rare characters), and tokens from
// FirstWord on are the whole words of Words.
const (
	EOG       engine.Token = 0
	FirstWord engine.Token = 257
	NVocab                 = 512
)

// Words are multi-byte tokens the tokenizer prefers over bytes (longest first is not
// needed: none is a prefix of another).
var Words = []string{"hello", "world", "€"}

// Byte is the token of one byte.
func Byte(b byte) engine.Token { return engine.Token(b) + 1 }

// Bytes is the byte-by-byte tokenization of s.
func Bytes(s string) []engine.Token {
	out := make([]engine.Token, len(s))
	for i := 0; i < len(s); i++ {
		out[i] = Byte(s[i])
	}
	return out
}

// Vocab implements engine.Vocab and the HTTP layer's tokenizer over the layout above.
type Vocab struct{}

// Piece implements engine.Vocab.
func (Vocab) Piece(tok engine.Token) []byte {
	switch {
	case tok == EOG:
		return nil
	case tok <= 256:
		return []byte{byte(tok - 1)}
	case int(tok-FirstWord) < len(Words):
		return []byte(Words[tok-FirstWord])
	}
	return []byte(fmt.Sprintf("<%d>", tok))
}

// IsEOG implements engine.Vocab.
func (Vocab) IsEOG(tok engine.Token) bool { return tok == EOG }

// Tokenize splits text into Words where they occur and bytes elsewhere.
func (v Vocab) Tokenize(text string, addSpecial, parseSpecial bool) ([]int32, error) {
	var out []int32
	for i := 0; i < len(text); {
		matched := false
		for w, word := range Words {
			if len(text)-i >= len(word) && text[i:i+len(word)] == word {
				out = append(out, FirstWord+engine.Token(w))
				i += len(word)
				matched = true
				break
			}
		}
		if !matched {
			out = append(out, Byte(text[i]))
			i++
		}
	}
	return out, nil
}

// Detokenize joins the pieces.
func (v Vocab) Detokenize(tokens []int32, removeSpecial, unparseSpecial bool) (string, error) {
	var b []byte
	for _, t := range tokens {
		b = append(b, v.Piece(t)...)
	}
	return string(b), nil
}

// TokenPiece is Piece (there are no special tokens to render).
func (v Vocab) TokenPiece(tok int32, special bool) []byte { return v.Piece(tok) }

// ValidToken reports a token inside the vocabulary.
func (Vocab) ValidToken(tok int32) bool { return tok >= 0 && tok < NVocab }

// NVocab is the vocabulary size.
func (Vocab) NVocab() int { return NVocab }

// CheckGrammar accepts every grammar (the fake does not constrain sampling).
func (Vocab) CheckGrammar(string) error { return nil }

// Backend is a fake engine.Backend: the k-th token a task samples is Script[k] (the
// last entry repeats), its logprob is TopLogprob(0), and the NProbs alternatives are
// the sampled token followed by the next token ids, with logprobs TopLogprob(1), ….
// It tracks each sequence's length and fails a batch that breaks position
// contiguity, so a scheduling bug shows up as an error rather than silently. A
// speculative Draft entry is sampled only when the task's previous sample in the batch
// equals its token (engine.BatchEntry.Draft), else it is engine.NotDrawn.
type Backend struct {
	mu       sync.Mutex
	script   []engine.Token
	pick     func(prompt string) []engine.Token // NewBackendFunc's
	seqLen   map[int]int
	samplers map[engine.TaskID]*sampler
	params   []engine.SamplingParams
}

type sampler struct {
	logprobs bool
	nProbs   int
	drawn    int
	script   []engine.Token
}

var _ engine.Backend = (*Backend)(nil)

// NewBackend returns a backend that samples script (which must not be empty).
func NewBackend(script []engine.Token) *Backend {
	if len(script) == 0 {
		panic("enginetest: empty script")
	}
	return &Backend{script: script, seqLen: map[int]int{}, samplers: map[engine.TaskID]*sampler{}}
}

// NewBackendFunc returns a backend whose tasks each sample the script pick returns for
// their prompt (as text), so a test can play a model that answers a conversation by
// what it holds: a tool call first, then, with the tool's result in the prompt, a
// reply (the agent CLIs' tool round trip). pick must not return an empty script.
func NewBackendFunc(pick func(prompt string) []engine.Token) *Backend {
	return &Backend{pick: pick, seqLen: map[int]int{}, samplers: map[engine.TaskID]*sampler{}}
}

// TopLogprob is the fake log-probability of the i-th most likely token.
func TopLogprob(i int) float32 { return -0.25 - float32(i) }

// Decode implements engine.Backend.
func (b *Backend) Decode(batch []engine.BatchEntry) ([]engine.Sampled, error) {
	b.mu.Lock()
	defer b.mu.Unlock()
	var out []engine.Sampled
	last := map[engine.TaskID]engine.Token{}
	for _, e := range batch {
		if e.Pos != b.seqLen[e.Seq] {
			return nil, fmt.Errorf("enginetest: seq %d gets pos %d but holds %d tokens", e.Seq, e.Pos, b.seqLen[e.Seq])
		}
		b.seqLen[e.Seq]++
		if !e.Sample {
			continue
		}
		s, ok := b.samplers[e.Task]
		if !ok {
			return nil, fmt.Errorf("enginetest: sampling for task %d without a sampler", e.Task)
		}
		if prev, ok := last[e.Task]; e.Draft && (!ok || prev != e.Token) {
			last[e.Task] = engine.NotDrawn
			out = append(out, engine.Sampled{Token: engine.NotDrawn})
			continue
		}
		tok := s.script[min(s.drawn, len(s.script)-1)]
		s.drawn++
		last[e.Task] = tok
		smp := engine.Sampled{Token: tok}
		if s.logprobs {
			smp.Logprob = TopLogprob(0)
			for i := 0; i < s.nProbs; i++ {
				smp.Top = append(smp.Top, engine.TokenLogprob{Token: (tok + engine.Token(i)) % NVocab, Logprob: TopLogprob(i)})
			}
		}
		out = append(out, smp)
	}
	return out, nil
}

// SeqRm implements engine.Backend.
func (b *Backend) SeqRm(seq, p0, p1 int) bool {
	b.mu.Lock()
	defer b.mu.Unlock()
	if p1 >= 0 && p1 < b.seqLen[seq] {
		return false // a hole: the engine never asks for one
	}
	b.seqLen[seq] = min(b.seqLen[seq], max(p0, 0))
	return true
}

// SeqCp implements engine.Backend.
func (b *Backend) SeqCp(src, dst, p0, p1 int) {
	b.mu.Lock()
	defer b.mu.Unlock()
	b.seqLen[dst] = max(b.seqLen[dst], p1)
}

// NewSampler implements engine.Backend.
func (b *Backend) NewSampler(task engine.TaskID, p engine.SamplingParams, logprobs bool, history []engine.Token) {
	b.mu.Lock()
	defer b.mu.Unlock()
	script := b.script
	if b.pick != nil {
		prompt, _ := Vocab{}.Detokenize(history, false, false)
		if script = b.pick(prompt); len(script) == 0 {
			panic("enginetest: empty script")
		}
	}
	b.samplers[task] = &sampler{logprobs: logprobs, nProbs: p.NProbs, script: script}
	b.params = append(b.params, p)
}

// FreeSampler implements engine.Backend.
// Caps implements engine.Backend: the fake has no ability beyond engine.Backend.
func (b *Backend) Caps() engine.Caps { return engine.Caps{} }

func (b *Backend) FreeSampler(task engine.TaskID) {
	b.mu.Lock()
	defer b.mu.Unlock()
	delete(b.samplers, task)
}

// Samplers is the number of samplers alive (a finished request must leave none).
func (b *Backend) Samplers() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return len(b.samplers)
}

// Params are the sampling parameters of every sampler created so far, in order.
func (b *Backend) Params() []engine.SamplingParams {
	b.mu.Lock()
	defer b.mu.Unlock()
	return append([]engine.SamplingParams(nil), b.params...)
}
