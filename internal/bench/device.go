package bench

import (
	"fmt"
	"io"

	"github.com/polykv/polykv/internal/app"
)

// maxBenchSessions is the largest B the decode benchmark takes (a GPU decodes 64 sessions
// at once without strain; the raw loop and the server get the same B).
const maxBenchSessions = 64

// benchPrompt is session s's prompt: the short distinct prompts, numbered past the 16th so
// every session still decodes its own text.
func benchPrompt(s int) string {
	p := benchPrompts[s%len(benchPrompts)]
	if s >= len(benchPrompts) {
		p = fmt.Sprintf("%s (%d)", p, s/len(benchPrompts))
	}
	return p
}

// printDevice prints the device the benchmark runs on, before any figure, so every table
// says whether it is a CPU or a GPU run.
func printDevice(w io.Writer, cfg app.Config) error {
	m, off, err := app.LoadModel(cfg)
	if err != nil {
		return err
	}
	m.Free()
	fmt.Fprintf(w, "device: %s\n", off.Summary())
	return nil
}
