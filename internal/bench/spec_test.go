package bench

import (
	"encoding/json"
	"testing"
)

// TestSpecMessagesDistinct: every round of the spec benchmark asks new questions, so a
// drafter that remembers earlier requests (ngram-mod's shared table) cannot replay an
// earlier round's answer to the same prompt.
func TestSpecMessagesDistinct(t *testing.T) {
	for _, w := range []string{"edit", "chat"} {
		seen := map[string]int{}
		for k := range specPrompts {
			b, err := json.Marshal(specMessages(w, k))
			if err != nil {
				t.Fatal(err)
			}
			if j, ok := seen[string(b)]; ok {
				t.Fatalf("%s: requests %d and %d are the same: %s", w, j, k, b)
			}
			seen[string(b)] = k
		}
	}
}
