package app

// Real-model tests of the reply shapes whose content comes from the model (issue 9):
// top-N logprobs, byte-fragment tokens, characters split across tokens.

import (
	"bufio"
	"bytes"
	"encoding/hex"
	"encoding/json"
	"math"
	"net/http"
	"reflect"
	"strings"
	"testing"
	"unicode/utf8"
)

// splitPrompt makes SmolLM2 answer in Japanese, whose characters it spells as two
// byte-fragment tokens each (checked below, so a model change cannot void the test).
const splitPrompt = "日本語: こんにちは、"

// legacyPieceBytes undoes the legacy shape's spelling of a token.
func legacyPieceBytes(t *testing.T, tok string) []byte {
	t.Helper()
	hx, ok := strings.CutPrefix(tok, "bytes:")
	if !ok {
		return []byte(tok)
	}
	b, err := hex.DecodeString(strings.ReplaceAll(hx, `\x`, ""))
	if err != nil {
		t.Fatalf("token %q: %v", tok, err)
	}
	return b
}

type legacyLogprobs struct {
	Tokens        []string             `json:"tokens"`
	TokenLogprobs []float64            `json:"token_logprobs"`
	TopLogprobs   []map[string]float64 `json:"top_logprobs"`
	TextOffset    []int                `json:"text_offset"`
	TokenIDs      []int                `json:"token_ids"`
}

func (l *legacyLogprobs) add(o legacyLogprobs) {
	l.Tokens = append(l.Tokens, o.Tokens...)
	l.TokenLogprobs = append(l.TokenLogprobs, o.TokenLogprobs...)
	l.TopLogprobs = append(l.TopLogprobs, o.TopLogprobs...)
	l.TextOffset = append(l.TextOffset, o.TextOffset...)
	l.TokenIDs = append(l.TokenIDs, o.TokenIDs...)
}

// legacyCompletion runs /v1/completions with logprobs, streamed or not, and returns the
// text and the logprobs (merged over the chunks when streamed).
func legacyCompletion(t *testing.T, base string, body map[string]any) (string, legacyLogprobs) {
	t.Helper()
	buf, _ := json.Marshal(body)
	resp, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(buf))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("completion %v: status %d", body, resp.StatusCode)
	}
	type choice struct {
		Text     string          `json:"text"`
		Logprobs *legacyLogprobs `json:"logprobs"`
	}
	var text strings.Builder
	var lp legacyLogprobs
	if body["stream"] != true {
		var out struct{ Choices []choice }
		if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || len(out.Choices) != 1 || out.Choices[0].Logprobs == nil {
			t.Fatalf("completion: %v %+v", err, out)
		}
		return out.Choices[0].Text, *out.Choices[0].Logprobs
	}
	sc := bufio.NewScanner(resp.Body)
	for sc.Scan() {
		data, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || data == "[DONE]" {
			continue
		}
		var chunk struct{ Choices []choice }
		if err := json.Unmarshal([]byte(data), &chunk); err != nil {
			t.Fatalf("chunk %q: %v", data, err)
		}
		for _, c := range chunk.Choices {
			text.WriteString(c.Text)
			if c.Logprobs != nil {
				lp.add(*c.Logprobs)
			}
		}
	}
	return text.String(), lp
}

// The legacy shape on real tokens: alternatives sorted, the greedy token first among
// them, fragments spelled "bytes:", and text_offset the character each token starts
// in, the same streamed and not.
func TestLegacyLogprobsRealModel(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 512, Parallel: 1})
	body := map[string]any{"prompt": splitPrompt, "max_tokens": 10, "temperature": 0, "logprobs": 5}
	text, lp := legacyCompletion(t, base, body)
	if strings.ContainsRune(text, utf8.RuneError) || !utf8.ValidString(text) {
		t.Fatalf("text %q", text)
	}
	n := len(lp.Tokens)
	if n != 10 || len(lp.TokenLogprobs) != n || len(lp.TopLogprobs) != n || len(lp.TextOffset) != n || len(lp.TokenIDs) != n {
		t.Fatalf("lengths %d %d %d %d %d, want 10", n, len(lp.TokenLogprobs), len(lp.TopLogprobs), len(lp.TextOffset), len(lp.TokenIDs))
	}
	var raw []byte
	fragments := 0
	for i, tok := range lp.Tokens {
		// The token's character offset: characters complete before its first byte.
		before := raw
		for len(before) > 0 && !utf8.Valid(before) {
			before = before[:len(before)-1]
		}
		if want := utf8.RuneCount(before); lp.TextOffset[i] != want {
			t.Fatalf("token %d %q: text_offset %d, want %d (offsets %v)", i, tok, lp.TextOffset[i], want, lp.TextOffset)
		}
		piece := legacyPieceBytes(t, tok)
		if strings.HasPrefix(tok, "bytes:") {
			fragments++
			if utf8.Valid(piece) {
				t.Fatalf("token %q is valid UTF-8 but spelled as bytes", tok)
			}
		}
		raw = append(raw, piece...)
		top := lp.TopLogprobs[i]
		if len(top) == 0 || len(top) > 5 {
			t.Fatalf("token %d: %d alternatives, want 1..5 (5 unless two share a spelling)", i, len(top))
		}
		best := math.Inf(-1)
		var mass float64
		for _, v := range top {
			best = math.Max(best, v)
			mass += math.Exp(v)
		}
		if top[tok] != lp.TokenLogprobs[i] || lp.TokenLogprobs[i] != best || mass > 1.0001 || best > 0 {
			t.Fatalf("token %d %q logprob %g: greedy must be the best of %v (mass %g)", i, tok, lp.TokenLogprobs[i], top, mass)
		}
	}
	if fragments < 2 {
		t.Fatalf("the model spelled %q without byte fragments (%q): the prompt no longer tests split characters", text, lp.Tokens)
	}
	if !strings.HasPrefix(string(raw), text) || utf8.RuneCount(raw) < utf8.RuneCountInString(text) {
		t.Fatalf("tokens join to %q, text is %q", raw, text)
	}
	body["stream"] = true
	stext, slp := legacyCompletion(t, base, body)
	if stext != text || !reflect.DeepEqual(slp, lp) {
		t.Fatalf("stream differs:\n%q %+v\n%q %+v", stext, slp, text, lp)
	}
}

// Chat top_logprobs on real logits, and reported before the sampler's transformations:
// a sampled request with top_k 2 and penalties still reports the same 5 alternatives
// at the first position as a greedy one (llama-server's n_probs does the same).
func TestChatTopLogprobsRealModel(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 512, Parallel: 1})
	type entry struct {
		Token   string  `json:"token"`
		Logprob float64 `json:"logprob"`
		RawB    []int   `json:"bytes"`
		Top     []struct {
			Token   string  `json:"token"`
			Logprob float64 `json:"logprob"`
			RawB    []int   `json:"bytes"`
		} `json:"top_logprobs"`
	}
	run := func(extra map[string]any) []entry {
		t.Helper()
		body := map[string]any{"messages": []map[string]any{{"role": "user", "content": "Name a colour."}},
			"max_tokens": 6, "logprobs": true, "top_logprobs": 5}
		for k, v := range extra {
			body[k] = v
		}
		code, out := post(t, base+"/v1/chat/completions", body)
		if code != 200 {
			t.Fatalf("chat: %d %v", code, out)
		}
		raw, _ := json.Marshal(out["choices"].([]any)[0].(map[string]any)["logprobs"].(map[string]any)["content"])
		var es []entry
		if err := json.Unmarshal(raw, &es); err != nil || len(es) == 0 {
			t.Fatalf("logprobs.content %s: %v", raw, err)
		}
		return es
	}
	greedy := run(map[string]any{"temperature": 0})
	for i, e := range greedy {
		if len(e.Top) != 5 {
			t.Fatalf("token %d: %d alternatives, want 5", i, len(e.Top))
		}
		if e.Top[0].Token != e.Token || e.Top[0].Logprob != e.Logprob {
			t.Fatalf("token %d %q %g: greedy token is not the first alternative %+v", i, e.Token, e.Logprob, e.Top)
		}
		var mass float64
		for j, a := range e.Top {
			if j > 0 && a.Logprob > e.Top[j-1].Logprob {
				t.Fatalf("token %d: alternatives not sorted: %+v", i, e.Top)
			}
			if len(a.RawB) == 0 || a.Logprob > 0 {
				t.Fatalf("token %d alternative %d: %+v", i, j, a)
			}
			mass += math.Exp(a.Logprob)
		}
		if mass > 1.0001 {
			t.Fatalf("token %d: alternatives carry probability %g", i, mass)
		}
	}
	sampled := run(map[string]any{"temperature": 0.9, "top_k": 2, "seed": 7, "repeat_penalty": 1.5, "presence_penalty": 1.5})
	if len(sampled[0].Top) != 5 || !reflect.DeepEqual(sampled[0].Top, greedy[0].Top) {
		t.Fatalf("first position differs under sampler transformations:\ngreedy  %+v\nsampled %+v", greedy[0].Top, sampled[0].Top)
	}
}

// A reply cut inside a split character (odd max_tokens on Japanese output) never
// carries U+FFFD; streamed it is the same text; each cut is a prefix of the longer
// reply.
func TestNoReplacementCharacterRealModel(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 512, Parallel: 1})
	full := ""
	texts := map[int]string{}
	for _, maxTok := range []int{5, 1, 2, 3} {
		body := map[string]any{"prompt": splitPrompt, "max_tokens": maxTok, "temperature": 0}
		code, out := post(t, base+"/v1/completions", body)
		if code != 200 {
			t.Fatalf("max_tokens %d: %d %v", maxTok, code, out)
		}
		text := out["choices"].([]any)[0].(map[string]any)["text"].(string)
		if strings.ContainsRune(text, utf8.RuneError) || !utf8.ValidString(text) {
			t.Fatalf("max_tokens %d: text %q carries U+FFFD", maxTok, text)
		}
		if maxTok == 5 {
			full = text
		} else if !strings.HasPrefix(full, text) {
			t.Fatalf("max_tokens %d: %q is not a prefix of %q", maxTok, text, full)
		}
		texts[maxTok] = text
		body["stream"] = true
		buf, _ := json.Marshal(body)
		resp, err := http.Post(base+"/v1/completions", "application/json", bytes.NewReader(buf))
		if err != nil {
			t.Fatal(err)
		}
		if streamed, _ := readCompletionSSE(t, resp); streamed != text {
			t.Fatalf("max_tokens %d: streamed %q, not streamed %q", maxTok, streamed, text)
		}
	}
	// The cuts at 1 and 3 tokens must have landed inside a character, or the test
	// proved nothing (each Japanese character is two tokens here).
	if texts[1] != "" || texts[3] != texts[2] || texts[2] == "" {
		t.Fatalf("cuts %v: the model no longer splits %q's reply into 2-token characters", texts, splitPrompt)
	}
}

func TestTokenizePiecesJoinRealModel(t *testing.T) {
	_, base := startServer(t, Config{NCtx: 256, Parallel: 1, APIKeys: []string{"k"}})
	content := "llama 🦙 and 日本語 and é ü"
	req, _ := http.NewRequest("POST", base+"/tokenize", strings.NewReader(`{"content":"`+content+`","with_pieces":true}`))
	req.Header.Set("Authorization", "Bearer k")
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var out struct {
		Tokens []struct {
			ID    int             `json:"id"`
			Piece json.RawMessage `json:"piece"`
		} `json:"tokens"`
	}
	if err := json.NewDecoder(resp.Body).Decode(&out); err != nil || resp.StatusCode != 200 {
		t.Fatalf("tokenize: %d %v", resp.StatusCode, err)
	}
	var joined []byte
	arrays := 0
	for _, tk := range out.Tokens {
		var s string
		var b []byte
		var nums []int
		switch {
		case json.Unmarshal(tk.Piece, &s) == nil:
			if strings.ContainsRune(s, utf8.RuneError) {
				t.Fatalf("piece %q carries U+FFFD", s)
			}
			b = []byte(s)
		case json.Unmarshal(tk.Piece, &nums) == nil:
			arrays++
			for _, n := range nums {
				b = append(b, byte(n))
			}
			if utf8.Valid(b) {
				t.Fatalf("valid piece %q sent as bytes", b)
			}
		default:
			t.Fatalf("piece %s", tk.Piece)
		}
		joined = append(joined, b...)
	}
	if string(joined) != content || arrays == 0 {
		t.Fatalf("pieces join to %q (%d byte arrays), want %q", joined, arrays, content)
	}
	// The key is wired from Config: without it the same route is refused.
	if code, _ := post(t, base+"/tokenize", map[string]any{"content": "x"}); code != 401 {
		t.Fatalf("tokenize without the API key: %d, want 401", code)
	}
	var health map[string]any
	if code := get(t, base+"/health", &health); code != 200 {
		t.Fatalf("health without the API key: %d", code)
	}
}
