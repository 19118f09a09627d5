package api_test

// Golden wire tests: every route's success and error replies, byte for byte, against
// testdata/golden. They guard the JSON clients see (field names, key order, omitempty,
// null against absent, number formatting) while the handlers' types change. After an
// intended change of the wire, regenerate with
//
//	go test ./internal/api -run TestGolden -update
//
// and read every diff. Time-varying values (ids, created, timings, rates, clocks) are
// normalized in place, on the raw bytes, so the rest stays exactly as sent.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/api"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/engine/enginetest"
)

// goldenCase is one request. Cases run in order against one server, so later cases
// see the pools and sessions earlier ones made.
type goldenCase struct {
	name   string
	method string
	path   string
	body   any // nil: no body; string: sent as is
	header []string
	sse    bool // read only the first event (an endless stream)
}

var (
	normID   = regexp.MustCompile(`:"(chatcmpl-|cmpl-|call_|resp_|resp-chain-resp_|msg_|rs_|fc_)[0-9A-Za-z]+"`)
	normTime = regexp.MustCompile(`"(created|created_at|ts|last_access_ts|prompt_ms|predicted_ms|prompt_per_token_ms|prompt_per_second|` +
		`predicted_per_token_ms|predicted_per_second|tps_ewma|aggregate_tps|prompt_tps|mean_active_tps|materialize_ms|` +
		`settle_remaining_ms|expires_in_ms)":-?[0-9][0-9.eE+-]*`)
)

func normalize(b []byte) []byte {
	b = normID.ReplaceAll(b, []byte(`:"${1}X"`))
	return normTime.ReplaceAll(b, []byte(`"$1":0`))
}

// goldenHeaders are the reply headers a client may read.
var goldenHeaders = []string{"Content-Type", "Allow", "Retry-After", "Trailer", "WWW-Authenticate", "X-Pool-Id",
	"X-Cached-Prefix-Tokens", "X-Sessions-Remaining", "X-Polykv-Reservation", "X-Polykv-Warning", "X-Polykv-Ignored-Tools"}

func toolServerScript() []engine.Token {
	return append(enginetest.Bytes(`<think>hm</think><tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>`), enginetest.EOG)
}

var weatherTools = []map[string]any{{"type": "function", "function": map[string]any{"name": "get_weather",
	"parameters": map[string]any{"type": "object", "properties": map[string]any{"city": map[string]any{"type": "string"}}}}}}

var (
	anthropicMsgs  = []map[string]any{{"role": "user", "content": "hi"}}
	responseTools  = []map[string]any{{"type": "function", "name": "get_weather", "parameters": weatherTools[0]["function"].(map[string]any)["parameters"]}}
	anthropicTools = []map[string]any{{"name": "get_weather", "input_schema": weatherTools[0]["function"].(map[string]any)["parameters"]}}
)

func goldenCases() (main, tools, keyed []goldenCase) {
	chat := func(extra map[string]any) map[string]any {
		b := map[string]any{"messages": chatMsgs, "max_tokens": 6, "seed": 1}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	text := func(extra map[string]any) map[string]any {
		b := map[string]any{"prompt": "hello", "max_tokens": 6, "seed": 1}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	resp := func(extra map[string]any) map[string]any {
		b := map[string]any{"input": "hi", "max_output_tokens": 6, "seed": 1}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	msg := func(extra map[string]any) map[string]any {
		b := map[string]any{"messages": anthropicMsgs, "max_tokens": 6, "seed": 1}
		for k, v := range extra {
			b[k] = v
		}
		return b
	}
	main = []goldenCase{
		{name: "health", method: "GET", path: "/health"},
		{name: "models", method: "GET", path: "/v1/models"},
		{name: "props", method: "GET", path: "/props"},
		{name: "slots_empty", method: "GET", path: "/slots"},
		{name: "tokenize", method: "POST", path: "/tokenize", body: map[string]any{"content": "hello é"}},
		{name: "tokenize_pieces", method: "POST", path: "/tokenize", body: map[string]any{"content": "hello é", "with_pieces": true}},
		{name: "tokenize_empty", method: "POST", path: "/tokenize", body: map[string]any{"content": ""}},
		{name: "tokenize_no_content", method: "POST", path: "/tokenize", body: map[string]any{}},
		{name: "tokenize_malformed", method: "POST", path: "/tokenize", body: `{"content": `},
		{name: "tokenize_wrong_type", method: "POST", path: "/tokenize", body: `{"content": 3}`},
		{name: "detokenize", method: "POST", path: "/detokenize", body: map[string]any{"tokens": []int{257, 33, 258}}},
		{name: "detokenize_no_tokens", method: "POST", path: "/detokenize", body: map[string]any{}},
		{name: "detokenize_out_of_vocab", method: "POST", path: "/detokenize", body: map[string]any{"tokens": []int{1, 9999}}},
		{name: "chat", method: "POST", path: "/v1/chat/completions", body: chat(nil)},
		{name: "chat_session", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"session_id": "s1"})},
		{name: "slots_session", method: "GET", path: "/slots"},
		{name: "chat_session_header", method: "POST", path: "/chat/completions", body: chat(nil), header: []string{"X-Session-Id", "s2"}},
		{name: "chat_logprobs", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"logprobs": true, "top_logprobs": 2, "max_tokens": 3})},
		{name: "chat_stream", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"stream": true})},
		{name: "chat_stream_usage", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"stream": true, "stream_options": map[string]any{"include_usage": true}})},
		{name: "chat_stream_logprobs", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"stream": true, "logprobs": true, "top_logprobs": 1, "max_tokens": 3})},
		{name: "chat_json_object", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"response_format": map[string]any{"type": "json_object"}})},
		{name: "chat_max_tokens_0", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"max_tokens": 0})},
		{name: "chat_top_logprobs_alone", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"top_logprobs": 2})},
		{name: "chat_no_messages", method: "POST", path: "/v1/chat/completions", body: map[string]any{"max_tokens": 2}},
		{name: "chat_bad_role", method: "POST", path: "/v1/chat/completions", body: map[string]any{"messages": []map[string]any{{"role": "robot", "content": "x"}}}},
		{name: "chat_too_long", method: "POST", path: "/v1/chat/completions", body: map[string]any{"messages": []map[string]any{{"role": "user", "content": strings.Repeat("x", 600)}}}},
		{name: "chat_tool_choice_no_tools", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tool_choice": "required"})},
		{name: "chat_n_2", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"n": 2})},
		{name: "chat_empty_body", method: "POST", path: "/v1/chat/completions", body: ""},
		{name: "chat_trailing", method: "POST", path: "/v1/chat/completions", body: `{"messages":[]} {}`},
		{name: "completion", method: "POST", path: "/v1/completions", body: text(nil)},
		{name: "completion_alias", method: "POST", path: "/completions", body: text(map[string]any{"prompt": []int{257, 258}, "session_id": "s3"})},
		{name: "completion_logprobs", method: "POST", path: "/v1/completions", body: text(map[string]any{"logprobs": 2, "max_tokens": 3})},
		{name: "completion_stream", method: "POST", path: "/v1/completions", body: text(map[string]any{"stream": true})},
		{name: "completion_stream_usage_logprobs", method: "POST", path: "/v1/completions", body: text(map[string]any{"stream": true, "logprobs": 1, "max_tokens": 3, "stream_options": map[string]any{"include_usage": true}})},
		{name: "completion_no_prompt", method: "POST", path: "/v1/completions", body: map[string]any{"max_tokens": 2}},
		{name: "completion_two_prompts", method: "POST", path: "/v1/completions", body: text(map[string]any{"prompt": []string{"a", "b"}})},
		{name: "completion_too_long", method: "POST", path: "/v1/completions", body: text(map[string]any{"prompt": strings.Repeat("y", 600)})},
		{name: "completion_bad_stop", method: "POST", path: "/v1/completions", body: text(map[string]any{"stop": 3})},
		{name: "completion_bad_temperature", method: "POST", path: "/v1/completions", body: text(map[string]any{"temperature": 3})},
		{name: "completion_pool_and_key", method: "POST", path: "/v1/completions", body: text(map[string]any{"pool_id": 1, "pool_key": "ab"})},
		{name: "completion_bad_pool_key", method: "POST", path: "/v1/completions", body: text(map[string]any{"pool_key": "xyz"})},
		{name: "completion_bad_pool_id", method: "POST", path: "/v1/completions", body: text(map[string]any{"pool_id": "one"})},
		{name: "completion_shared_prefix_no_pool", method: "POST", path: "/v1/completions", body: text(map[string]any{"shared_prefix_n_tokens": 3})},
		{name: "completion_shared_prefix_negative", method: "POST", path: "/v1/completions", body: text(map[string]any{"pool_id": 1, "shared_prefix_n_tokens": -3})},
		{name: "completion_reservation_no_pool", method: "POST", path: "/v1/completions", body: text(map[string]any{"reservation_id": "r"})},
		{name: "completion_max_tokens_over_ctx", method: "POST", path: "/v1/completions", body: text(map[string]any{"max_completion_tokens": 100000})}, // capped at the context
		{name: "completion_bad_top_p", method: "POST", path: "/v1/completions", body: text(map[string]any{"top_p": 1.5, "top_k": -1})},
		{name: "completion_bad_top_k", method: "POST", path: "/v1/completions", body: text(map[string]any{"top_k": -1, "min_p": 2})},
		{name: "completion_bad_min_p", method: "POST", path: "/v1/completions", body: text(map[string]any{"min_p": 2, "presence_penalty": 3})},
		{name: "completion_bad_presence", method: "POST", path: "/v1/completions", body: text(map[string]any{"presence_penalty": 3, "repeat_penalty": 0})},
		{name: "completion_bad_repeat_penalty", method: "POST", path: "/v1/completions", body: text(map[string]any{"repeat_penalty": 0, "repeat_last_n": -2})},
		{name: "completion_bad_repeat_last_n", method: "POST", path: "/v1/completions", body: text(map[string]any{"repeat_last_n": -2, "stop": 1})},
		{name: "completion_bad_logprobs", method: "POST", path: "/v1/completions", body: text(map[string]any{"logprobs": "x", "session_id": strings.Repeat("s", 300)})},
		{name: "completion_long_session", method: "POST", path: "/v1/completions", body: text(map[string]any{"session_id": strings.Repeat("s", 300)})},
		{name: "completion_sampling_ok", method: "POST", path: "/v1/completions", body: text(map[string]any{"temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1,
			"presence_penalty": 1, "frequency_penalty": -1, "repeat_penalty": 1.1, "repeat_last_n": -1, "max_tokens": -1, "stop": []string{"o w"}})},
		{name: "chat_named_tool_no_tools", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tool_choice": map[string]any{"type": "function", "function": map[string]any{"name": "f"}}})},
		{name: "chat_bad_response_format", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"response_format": map[string]any{"type": "xml"}})},
		{name: "chat_bad_reasoning_format", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"reasoning_format": "loud"})},
		{name: "completion_unknown_pool", method: "POST", path: "/v1/completions", body: text(map[string]any{"pool_id": 77})},
		{name: "apply_template", method: "POST", path: "/apply-template", body: map[string]any{"messages": chatMsgs}},
		{name: "apply_template_bad", method: "POST", path: "/apply-template", body: map[string]any{"messages": "x"}},
		{name: "chat_render", method: "POST", path: "/v1/chat/completions/render", body: map[string]any{"messages": chatMsgs}},
		{name: "chat_render_bad", method: "POST", path: "/v1/chat/completions/render", body: map[string]any{"messages": []any{}}},
		{name: "completions_render", method: "POST", path: "/v1/completions/render", body: map[string]any{"prompt": "hello"}},
		{name: "completions_render_bad", method: "POST", path: "/v1/completions/render", body: map[string]any{"prompt": ""}},
		{name: "pools_empty", method: "GET", path: "/polykv/pools"},
		{name: "pool_create_prompt", method: "POST", path: "/polykv/pools", body: map[string]any{"prompt": "hello world, a shared prefix"}},
		{name: "pool_create_messages", method: "POST", path: "/polykv/pools", body: map[string]any{"messages": []map[string]any{{"role": "system", "content": "be brief"}}, "pin": true}},
		{name: "pool_create_two_sources", method: "POST", path: "/polykv/pools", body: map[string]any{"prompt": "a", "tokens": []int{1}}},
		{name: "pool_create_branch_pos", method: "POST", path: "/polykv/pools", body: map[string]any{"prompt": "a", "branch_pos": 1}},
		{name: "pool_fork", method: "POST", path: "/polykv/pools/1/fork", body: map[string]any{"branch_pos": 5, "prompt": "hello world, a shared prefix and more"}},
		{name: "pool_fork_mismatch", method: "POST", path: "/polykv/pools/1/fork", body: map[string]any{"branch_pos": 5, "prompt": "other text entirely"}},
		{name: "pool_fork_no_branch_pos", method: "POST", path: "/polykv/pools/1/fork", body: map[string]any{"prompt": "x"}},
		{name: "pool_chat", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"pool_id": 2, "session_id": "p1",
			"messages": []map[string]any{{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}}})},
		{name: "pool_completion", method: "POST", path: "/v1/completions", body: text(map[string]any{"pool_id": "1", "prompt": "hello world, a shared prefix!", "session_id": "p2"})},
		{name: "pool_completion_stream", method: "POST", path: "/v1/completions", body: text(map[string]any{"pool_id": 1, "prompt": "hello world, a shared prefix?", "stream": true})},
		{name: "pools_list", method: "GET", path: "/polykv/pools"},
		{name: "pool_get", method: "GET", path: "/polykv/pools/3"},
		{name: "pool_get_missing", method: "GET", path: "/polykv/pools/42"},
		{name: "pool_get_bad_id", method: "GET", path: "/polykv/pools/abc"},
		{name: "pool_pin", method: "POST", path: "/polykv/pools/1/pin"},
		{name: "pool_unpin", method: "POST", path: "/polykv/pools/1/unpin"},
		{name: "pool_flush", method: "POST", path: "/polykv/pools/1/flush"},
		{name: "pool_evict", method: "POST", path: "/polykv/pools/3/evict"},
		{name: "pool_pin_missing", method: "POST", path: "/polykv/pools/42/pin"},
		{name: "capacity", method: "GET", path: "/polykv/pools/1/capacity?expected_tokens=10"},
		{name: "capacity_session", method: "GET", path: "/polykv/pools/2/capacity?session_id=p1"},
		{name: "capacity_bad", method: "GET", path: "/polykv/pools/1/capacity?expected_tokens=-1"},
		{name: "capacity_missing", method: "GET", path: "/polykv/pools/42/capacity"},
		{name: "admission_get", method: "GET", path: "/polykv/pools/1/admission"},
		{name: "admission_set", method: "POST", path: "/polykv/pools/1/admission", body: map[string]any{"target_tps_per_session": 5.5, "mode": "enforced"}},
		{name: "admission_set_bad", method: "POST", path: "/polykv/pools/1/admission", body: map[string]any{"mode": "strict"}},
		{name: "admission_set_throttle_bad", method: "POST", path: "/polykv/pools/1/admission", body: map[string]any{"throttle": "always"}},
		{name: "admission_set_skip_bad", method: "POST", path: "/polykv/pools/1/admission", body: map[string]any{"throttle_max_skip": 1}},
		{name: "admission_get_missing", method: "GET", path: "/polykv/pools/42/admission"},
		{name: "reserve", method: "POST", path: "/polykv/pools/2/reservations", body: map[string]any{"ttl_ms": 60000, "expected_tokens": 10}},
		{name: "reserve_no_body", method: "POST", path: "/polykv/pools/2/reservations"},
		{name: "reserve_bad_ttl", method: "POST", path: "/polykv/pools/2/reservations", body: map[string]any{"ttl_ms": 0}},
		{name: "reserve_release", method: "DELETE", path: "/polykv/pools/2/reservations/rsv-2-1"},
		{name: "reserve_release_missing", method: "DELETE", path: "/polykv/pools/2/reservations/rsv-2-99"},
		{name: "reserve_chat", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"pool_id": 2, "reservation_id": "rsv-2-2", "session_id": "p3"})},
		{name: "saturated_setup", method: "POST", path: "/polykv/pools/2/admission", body: map[string]any{"target_tps_per_session": 1e9, "mode": "enforced", "guarantee_min_sessions": 0, "settle_max_ms": 0, "settle_tokens": 0}},
		{name: "saturated_chat", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"pool_id": 2, "session_id": "p4"})},
		{name: "saturated_chat_overcommit", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"pool_id": 2, "session_id": "p5", "overcommit": true})},
		{name: "tps_once", method: "GET", path: "/polykv/tps?once=1"},
		{name: "tps_json", method: "GET", path: "/polykv/tps", header: []string{"Accept", "application/json"}},
		{name: "tps_stream", method: "GET", path: "/polykv/tps?interval_ms=50", sse: true},
		{name: "tps_bad_interval", method: "GET", path: "/polykv/tps?interval_ms=1"},
		{name: "pool_release_parent", method: "DELETE", path: "/polykv/pools/1"},
		{name: "pool_release", method: "DELETE", path: "/polykv/pools/3"},
		{name: "pool_release_missing", method: "DELETE", path: "/polykv/pools/42"},
		{name: "pools_after", method: "GET", path: "/polykv/pools"},
		{name: "responses", method: "POST", path: "/v1/responses", body: resp(nil)},
		{name: "responses_items", method: "POST", path: "/v1/responses", body: resp(map[string]any{"instructions": "be brief", "store": false, "input": []any{
			map[string]any{"role": "user", "content": "hi"}, map[string]any{"type": "message", "role": "assistant", "content": []any{map[string]any{"type": "output_text", "text": "hello"}}},
			map[string]any{"role": "user", "content": []any{map[string]any{"type": "input_text", "text": "again"}}}}})},
		{name: "responses_session", method: "POST", path: "/v1/responses", body: resp(map[string]any{"session_id": "r1", "temperature": 0, "top_p": 0.5})},
		{name: "responses_stream", method: "POST", path: "/v1/responses", body: resp(map[string]any{"stream": true})},
		{name: "responses_no_input", method: "POST", path: "/v1/responses", body: map[string]any{"max_output_tokens": 6}},
		{name: "responses_bad_item_type", method: "POST", path: "/v1/responses", body: resp(map[string]any{"input": []any{map[string]any{"type": "computer_call"}}})},
		{name: "responses_orphan_output", method: "POST", path: "/v1/responses", body: resp(map[string]any{"input": []any{
			map[string]any{"role": "user", "content": "hi"}, map[string]any{"type": "function_call_output", "call_id": "call_9", "output": "42"}}})},
		{name: "responses_unknown_previous", method: "POST", path: "/v1/responses", body: resp(map[string]any{"previous_response_id": "resp_nope"})},
		{name: "responses_bad_max_output", method: "POST", path: "/v1/responses", body: resp(map[string]any{"max_output_tokens": 0})},
		{name: "responses_bad_format", method: "POST", path: "/v1/responses", body: resp(map[string]any{"text": map[string]any{"format": map[string]any{"type": "xml"}}})},
		{name: "responses_builtin_tool_ignored", method: "POST", path: "/v1/responses", body: resp(map[string]any{"tools": []any{map[string]any{"type": "web_search"}}})},
		{name: "responses_bad_namespace", method: "POST", path: "/v1/responses", body: resp(map[string]any{"tools": []any{map[string]any{"type": "namespace", "name": "ns",
			"tools": []any{map[string]any{"type": "web_search"}}}}})},
		{name: "responses_foreign_encrypted_reasoning", method: "POST", path: "/v1/responses", body: resp(map[string]any{"input": []any{
			map[string]any{"type": "reasoning", "summary": []any{}, "encrypted_content": "gAAAAAB-not-ours"}, map[string]any{"role": "user", "content": "hi"}}})},
		{name: "responses_codex_shape", method: "POST", path: "/v1/responses", body: resp(map[string]any{"store": false, "prompt_cache_key": "thread-1",
			"include": []string{"reasoning.encrypted_content"}, "reasoning": map[string]any{"summary": "auto"}, "parallel_tool_calls": true,
			"client_metadata": map[string]any{"turn_id": "t1"}, "input": []any{
				map[string]any{"type": "message", "role": "developer", "content": []any{map[string]any{"type": "input_text", "text": "be precise"}}},
				map[string]any{"type": "message", "role": "developer", "content": []any{map[string]any{"type": "input_text", "text": "skills"}}},
				map[string]any{"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": "<environment_context/>"}}},
				map[string]any{"type": "message", "role": "user", "content": []any{map[string]any{"type": "input_text", "text": "hi"}}}}})},
		{name: "responses_get_missing", method: "GET", path: "/v1/responses/resp_nope"},
		{name: "responses_delete_missing", method: "DELETE", path: "/v1/responses/resp_nope"},
		{name: "messages", method: "POST", path: "/v1/messages", body: msg(nil)},
		{name: "messages_system_blocks", method: "POST", path: "/v1/messages", body: msg(map[string]any{"system": []any{map[string]any{"type": "text", "text": "be brief"}},
			"stop_sequences": []string{"llo"}, "session_id": "m1"})},
		{name: "messages_stream", method: "POST", path: "/v1/messages", body: msg(map[string]any{"stream": true})},
		{name: "messages_count_tokens", method: "POST", path: "/v1/messages/count_tokens", body: map[string]any{"messages": anthropicMsgs}},
		{name: "messages_no_max_tokens", method: "POST", path: "/v1/messages", body: map[string]any{"messages": anthropicMsgs}},
		{name: "messages_orphan_tool_result", method: "POST", path: "/v1/messages", body: msg(map[string]any{"messages": []any{map[string]any{"role": "user",
			"content": []any{map[string]any{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}}}}})},
		{name: "messages_bad_block", method: "POST", path: "/v1/messages", body: msg(map[string]any{"messages": []any{map[string]any{"role": "user",
			"content": []any{map[string]any{"type": "image", "source": map[string]any{}}}}}})},
		{name: "messages_bad_role", method: "POST", path: "/v1/messages", body: msg(map[string]any{"messages": []any{map[string]any{"role": "tool", "content": "x"}}})},
		{name: "messages_claude_code_shape", method: "POST", path: "/v1/messages?beta=true", header: []string{"Anthropic-Beta", "claude-code-20250219,context-management-2025-06-27"},
			body: msg(map[string]any{"max_tokens": 32000, "system": []any{
				map[string]any{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.328.28b; cc_entrypoint=sdk-cli;"},
				map[string]any{"type": "text", "text": "You are an agent.", "cache_control": map[string]any{"type": "ephemeral"}}},
				"messages": []any{map[string]any{"role": "user", "content": []any{map[string]any{"type": "text", "text": "<system-reminder>r</system-reminder>"}}},
					map[string]any{"role": "system", "content": []any{map[string]any{"type": "text", "text": "# Environment"}}},
					map[string]any{"role": "user", "content": "hi"}},
				"thinking": map[string]any{"type": "adaptive", "display": "omitted"}, "output_config": map[string]any{"effort": "high"},
				"context_management": map[string]any{"edits": []any{map[string]any{"type": "clear_thinking_20251015", "keep": "all"}}},
				"metadata":           map[string]any{"user_id": `{"device_id":"d","account_uuid":"","session_id":"cc-session-1"}`},
				"tools":              []any{map[string]any{"type": "web_search_20250305", "name": "web_search"}}})},
		{name: "messages_bad_context_edit", method: "POST", path: "/v1/messages", body: msg(map[string]any{"context_management": map[string]any{"edits": []any{
			map[string]any{"type": "clear_tool_uses_20250919"}}}})},
		{name: "messages_bad_effort", method: "POST", path: "/v1/messages", body: msg(map[string]any{"output_config": map[string]any{"effort": "extreme"}})},
		{name: "messages_malformed", method: "POST", path: "/v1/messages", body: `{"messages": `},
		{name: "messages_too_long", method: "POST", path: "/v1/messages", body: msg(map[string]any{"messages": []map[string]any{{"role": "user", "content": strings.Repeat("x", 600)}}})},
		{name: "route_404", method: "GET", path: "/no/such/route"},
		{name: "route_405", method: "DELETE", path: "/v1/models"},
	}
	tools = []goldenCase{
		{name: "tools_chat", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tools": weatherTools, "max_tokens": 200})},
		{name: "tools_chat_stream", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tools": weatherTools, "max_tokens": 200, "stream": true})},
		{name: "tools_chat_required", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tools": weatherTools, "max_tokens": 200, "tool_choice": "required"})},
		{name: "tools_chat_reasoning_none", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"max_tokens": 200, "reasoning_format": "none"})},
		{name: "tools_chat_thinking", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"max_tokens": 8})},
		{name: "tools_chat_thinking_stream", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"max_tokens": 8, "stream": true})},
		{name: "tools_unknown_name", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tools": weatherTools, "tool_choice": map[string]any{"type": "function", "function": map[string]any{"name": "nope"}}})},
		{name: "tools_named", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tools": weatherTools, "max_tokens": 200, "tool_choice": map[string]any{"type": "function", "function": map[string]any{"name": "get_weather"}}})},
		{name: "tools_with_response_format", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tools": weatherTools, "tool_choice": "required", "response_format": map[string]any{"type": "json_object"}})},
		{name: "tools_bad", method: "POST", path: "/v1/chat/completions", body: chat(map[string]any{"tools": []any{map[string]any{"type": "x"}}})},
		{name: "tools_pool", method: "POST", path: "/polykv/pools", body: map[string]any{"messages": chatMsgs, "tools": weatherTools}},
		{name: "responses_tools", method: "POST", path: "/v1/responses", body: resp(map[string]any{"tools": responseTools, "max_output_tokens": 200})},
		{name: "responses_tools_stream", method: "POST", path: "/v1/responses", body: resp(map[string]any{"tools": responseTools, "max_output_tokens": 200, "stream": true})},
		{name: "responses_namespace_call", method: "POST", path: "/v1/responses", body: resp(map[string]any{"max_output_tokens": 200, "tools": []any{
			map[string]any{"type": "namespace", "name": "weather_v1", "description": "Weather tools.", "tools": responseTools}}})},
		{name: "responses_tools_named", method: "POST", path: "/v1/responses", body: resp(map[string]any{"tools": responseTools, "max_output_tokens": 200,
			"tool_choice": map[string]any{"type": "function", "name": "get_weather"}})},
		{name: "messages_tools", method: "POST", path: "/v1/messages", body: msg(map[string]any{"tools": anthropicTools, "max_tokens": 200})},
		{name: "messages_tools_stream", method: "POST", path: "/v1/messages", body: msg(map[string]any{"tools": anthropicTools, "max_tokens": 200, "stream": true})},
		{name: "messages_tools_any", method: "POST", path: "/v1/messages", body: msg(map[string]any{"tools": anthropicTools, "max_tokens": 200, "tool_choice": map[string]any{"type": "any"}})},
		{name: "tools_pool_without_messages", method: "POST", path: "/polykv/pools", body: map[string]any{"prompt": "x", "tools": weatherTools}},
	}
	keyed = []goldenCase{
		{name: "auth_missing", method: "GET", path: "/v1/models"},
		{name: "auth_health", method: "GET", path: "/health"},
		{name: "auth_messages_missing", method: "POST", path: "/v1/messages", body: msg(nil)},
		{name: "auth_messages_x_api_key", method: "POST", path: "/v1/messages", body: msg(map[string]any{"max_tokens": 1}), header: []string{"X-Api-Key", "secret"}},
	}
	return main, tools, keyed
}

func TestGolden(t *testing.T) {
	main, tools, keyed := goldenCases()
	dir := filepath.Join("testdata", "golden")
	var index strings.Builder
	written := map[string]bool{}
	run := func(base string, cases []goldenCase) {
		for _, c := range cases {
			status, head, body := goldenDo(t, base, c)
			ext := ".json"
			if strings.HasPrefix(head.Get("Content-Type"), "text/event-stream") {
				ext = ".sse"
			}
			fmt.Fprintf(&index, "%s: %s %s -> %d", c.name, c.method, c.path, status)
			for _, h := range goldenHeaders {
				if v := head.Values(h); len(v) > 0 {
					fmt.Fprintf(&index, " | %s: %s", h, strings.Join(v, ", "))
				}
			}
			index.WriteString("\n")
			written[c.name+ext] = true
			api.CheckGolden(t, filepath.Join(dir, c.name+ext), normalize(body))
		}
	}
	cfg := engine.Config{NCtx: 512, Parallel: 4, MaxPools: 4, NBatch: 64, MaxQueue: 8, BytesPerCell: 1024}
	base, _ := newServerCfg(t, cfg, append(enginetest.Bytes("hello world"), enginetest.EOG))
	run(base, main)
	toolBase, _ := newServerCfg(t, cfg, toolServerScript())
	run(toolBase, tools)
	keyBase, _ := newServer(t, enginetest.Bytes("a"), "secret")
	run(keyBase, keyed)
	api.CheckGolden(t, filepath.Join(dir, "index.txt"), []byte(index.String()))
	// A file no case wrote is stale (a renamed case, or a reply that changed type).
	files, _ := filepath.Glob(filepath.Join(dir, "*"))
	for _, f := range files {
		if name := filepath.Base(f); !written[name] && name != "index.txt" && name != "errors.txt" {
			t.Errorf("%s: no case writes it; remove it", f)
		}
	}
}

func goldenDo(t *testing.T, base string, c goldenCase) (int, http.Header, []byte) {
	t.Helper()
	var rd io.Reader
	switch b := c.body.(type) {
	case nil:
	case string:
		rd = strings.NewReader(b)
	default:
		raw, err := json.Marshal(b)
		if err != nil {
			t.Fatal(err)
		}
		rd = bytes.NewReader(raw)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	req, err := http.NewRequestWithContext(ctx, c.method, base+c.path, rd)
	if err != nil {
		t.Fatal(err)
	}
	if rd != nil {
		req.Header.Set("Content-Type", "application/json")
	}
	for i := 0; i+1 < len(c.header); i += 2 {
		req.Header.Set(c.header[i], c.header[i+1])
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("%s: %v", c.name, err)
	}
	defer resp.Body.Close()
	if c.sse {
		// An endless stream: the first event only.
		var b bytes.Buffer
		rd := bufio.NewReader(resp.Body)
		for {
			line, err := rd.ReadString('\n')
			b.WriteString(line)
			if err != nil || line == "\n" {
				break
			}
		}
		return resp.StatusCode, resp.Header, b.Bytes()
	}
	raw, err := io.ReadAll(resp.Body)
	if err != nil {
		t.Fatalf("%s: %v", c.name, err)
	}
	for k, v := range resp.Trailer {
		resp.Header[k] = v
	}
	return resp.StatusCode, resp.Header, raw
}
