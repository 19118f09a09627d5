package app

import (
	"slices"
	"testing"
	"time"

	"github.com/alicebob/miniredis/v2"

	"github.com/polykv/polykv/internal/tier"
)

// waitSharedWrites waits until a's store has written at least n entries to the shared
// level: a request's write-through is planned when it ends and runs with the next
// step's operations, after its response.
func waitSharedWrites(t *testing.T, a *App, n int64) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	writes := func() int64 { return a.Tier.Stats().Level(a.Tier.SharedLocation()).Writes }
	for {
		a.Tier.Flush()
		if writes() >= n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("replica A wrote %d entries to the shared level, want %d", writes(), n)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// TestSharedTierAcrossReplicas (issue 44): two replicas share a directory (each with
// no RAM tier and no --pool-dir of its own, so nothing but the shared level can hold
// KV). A serves a ~2,000-token prompt; its prompt's chunks reach the shared directory
// (write-through at the request's end). B, which never saw the prompt, serves it as a
// plain request and C, cold too, as a session's first turn: each restores at least 90%
// of the prompt from the shared level (restored_n) and gives the greedy tokens and
// logprobs of a cold server that prefills all of it.
func TestSharedTierAcrossReplicas(t *testing.T) {
	replica := withDefaults(Config{ModelPath: modelPath(t), NCtx: 4096, Parallel: 1, MaxPools: 2, SharedDir: t.TempDir()})
	fleetAcrossReplicas(t, replica, "shared", []string{"", "agent-7"})
}

// TestRemoteTierAcrossReplicas: the same with the fleet's level in a Redis server
// (--tier-remote; a miniredis server in the test) instead of a shared directory: the
// replica that never saw the prompt loads ≥ 90% of it from the store, with a cold
// prefill's tokens and logprobs.
func TestRemoteTierAcrossReplicas(t *testing.T) {
	srv := miniredis.RunT(t)
	replica := withDefaults(Config{ModelPath: modelPath(t), NCtx: 4096, Parallel: 1, MaxPools: 2, RemoteTier: "redis://" + srv.Addr() + "/0"})
	fleetAcrossReplicas(t, replica, "remote", []string{""})
}

// fleetAcrossReplicas: replica A (no RAM tier, so every entry is the fleet level's)
// serves a ~2,000-token prompt; fresh replicas of the same config, one per session name
// ("" = a plain request), serve it again and must restore it from the fleet level loc.
func fleetAcrossReplicas(t *testing.T, replica Config, loc string, sessions []string) {
	t.Helper()
	replica.PoolRAMMB = 0
	a, baseA := openServer(t, replica)
	prompt := tokenize(t, a, longSystem(t, a, 2000)+" Summarise what the tools above can do for a ledger audit.")
	if len(prompt) < 2000 || len(prompt) > 2200 {
		t.Fatalf("prompt of %d tokens", len(prompt))
	}
	first := agentTurn(t, baseA, prompt, "", 8)
	if first.restoredN != 0 {
		t.Fatalf("A restored %d tokens from an empty shared directory", first.restoredN)
	}
	chunks := int64((len(prompt) + 255) / 256)
	waitSharedWrites(t, a, chunks)

	_, coldBase := startServer(t, Config{NCtx: 4096, Parallel: 1, MaxPools: 2})
	wantIDs, wantLPs, _ := greedyLogprobs(t, coldBase, prompt, 0, 8)
	if !slices.Equal(first.ids, wantIDs) || !slices.Equal(first.lps, wantLPs) {
		t.Fatalf("A's own prefill differs from the cold server's: %v vs %v", first.ids, wantIDs)
	}
	for _, session := range sessions {
		b, baseB := openServer(t, replica)
		got := agentTurn(t, baseB, prompt, session, 8)
		if got.restoredN < len(prompt)*9/10 {
			t.Fatalf("session %q: B restored %d of %d prompt tokens (prefilled %d), want >= 90%%", session, got.restoredN, len(prompt), got.promptN)
		}
		if !slices.Equal(got.ids, wantIDs) || !slices.Equal(got.lps, wantLPs) {
			t.Fatalf("session %q: B's tokens %v logprobs %v, a cold prefill gives %v %v", session, got.ids, got.lps, wantIDs, wantLPs)
		}
		t.Logf("session %q: B prefilled %d, restored %d of %d prompt tokens", session, got.promptN, got.restoredN, len(prompt))
		st := b.Tier.Stats()
		if st.Restores[tier.Location(loc)] == 0 {
			t.Fatalf("session %q: B's restores %v, want them from the %s level", session, st.Restores, loc)
		}
	}

	// The conversation's next turn on another fresh replica: its prompt continues A's
	// past A's last chunk boundary, so the partial chunk that ended A's prompt is found
	// too (tier.Store.Run) and only the new words are prefilled, with a cold prefill's
	// tokens and logprobs.
	next := append(slices.Clone(prompt), tokenize(t, a, " Then list the ones that write.")[1:]...)
	wantIDs, wantLPs, _ = greedyLogprobs(t, coldBase, next, 0, 8)
	_, baseC := openServer(t, replica)
	got := agentTurn(t, baseC, next, "", 8)
	if got.restoredN != len(prompt) || got.promptN != len(next)-len(prompt) {
		t.Fatalf("next turn: restored %d, prefilled %d of %d tokens; want A's %d restored (its last, partial chunk too)", got.restoredN, got.promptN, len(next), len(prompt))
	}
	if !slices.Equal(got.ids, wantIDs) || !slices.Equal(got.lps, wantLPs) {
		t.Fatalf("next turn: tokens %v logprobs %v, a cold prefill gives %v %v", got.ids, got.lps, wantIDs, wantLPs)
	}
	if loc != "shared" {
		return // a remote store lists lengths, not entries to read heads of (commonPart)
	}

	// A teammate's first turn on a fresh replica: the same system prompt, its own
	// question. The chunk where the two part is A's, shared only up to the question:
	// found by its common part, loaded, and cut there.
	sys := tokenize(t, a, longSystem(t, a, 2000))
	mate := tokenize(t, a, longSystem(t, a, 2000)+" Which of these tools checks balances?")
	whole := len(sys) / 256 * 256
	wantIDs, wantLPs, _ = greedyLogprobs(t, coldBase, mate, 0, 8)
	_, baseD := openServer(t, replica)
	got = agentTurn(t, baseD, mate, "", 8)
	if got.restoredN < len(sys)-2 || got.restoredN <= whole {
		t.Fatalf("teammate: restored %d, prefilled %d of %d tokens; want the %d of the system prompt restored, past the %d of its whole chunks", got.restoredN, got.promptN, len(mate), len(sys), whole)
	}
	if !slices.Equal(got.ids, wantIDs) || !slices.Equal(got.lps, wantLPs) {
		t.Fatalf("teammate: tokens %v logprobs %v, a cold prefill gives %v %v", got.ids, got.lps, wantIDs, wantLPs)
	}
	t.Logf("teammate: restored %d, prefilled %d of %d (system prompt %d)", got.restoredN, got.promptN, len(mate), len(sys))
}
