package bench

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"strings"
)

// eachChunk reads an OpenAI-style event stream (`data: {...}` lines; `data: [DONE]`,
// comments and blank lines skipped) and hands each chunk, decoded into a fresh T, to fn,
// in order. The workloads' clients differ only in what they take from a chunk. A chunk
// that is not JSON, fn's error or the reader's ends the stream.
func eachChunk[T any](r io.Reader, fn func(*T) error) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 4<<20) // a chunk with logprobs or a long tool call
	for sc.Scan() {
		line, ok := strings.CutPrefix(sc.Text(), "data: ")
		if !ok || !strings.HasPrefix(line, "{") {
			continue
		}
		var chunk T
		if err := json.Unmarshal([]byte(line), &chunk); err != nil {
			return fmt.Errorf("stream chunk: %v: %s", err, line)
		}
		if err := fn(&chunk); err != nil {
			return err
		}
	}
	return sc.Err()
}

// deltaChoice is a streamed chat chunk's choice: the text it adds.
type deltaChoice struct {
	Delta struct {
		Content string `json:"content"`
	} `json:"delta"`
}
