package engine

import "fmt"

// A task's life is one field, status, and its moves are one table (statusMoves): the
// scheduler reads a task's phase there and changes it only through setStatus, which
// refuses any move the table lacks as a lifecycle violation (Violations: a scheduler
// bug the tests assert never happens). It replaces the booleans the phases grew as
// (tierWait, loadWait, hasNext, and "no sequence yet" read from the slot), whose
// combinations nothing kept consistent. In the spirit of vLLM's RequestStatus:
//
//	waiting ──seat──▶ prefilling ───first token───▶ decoding
//	   │               │  ▲    │  ▲                   │
//	   │  restore/load ▼  │    ▼  │ Found             │
//	   │            loading   lookup                  │
//	   └───────────────┴────────┴────── end ──────────┴──▶ done
//
// loading waits for the tier's answer (Restored, Loaded); lookup (only with a fleet
// level, Config.TierFleet) is a request seated after a wait in the queue, waiting for
// its OpLookup's answer, after which it may go on to loading.
//
// A pool's materialization (kindMaterialize) is a task too: it waits, prefills (or
// loads, restoring from the tier) and ends when the pool is resident; it never decodes.
type status uint8

const (
	// statusWaiting: in the queue, or held by an enforced pool's admission gate; it
	// holds no sequence.
	statusWaiting status = iota
	// statusPrefilling: seated; its prompt (a pool: the pool's tokens) is prefilled in
	// chunks, from what its sequence already holds.
	statusPrefilling
	// statusLoading: seated; its KV comes from the tier below the cache (an OpRestore of
	// the pool it rebuilds, an OpLoad of its prompt's segments) and nothing of it is
	// prefilled until the answer (Restored, Loaded) comes.
	statusLoading
	// statusDecoding: a token is sampled (task.next) and waits to be decoded.
	statusDecoding
	// statusLookup: seated after a wait in the queue; the tier's fleet level is asked
	// what it holds of the prompt (OpLookup), as vLLM's WAITING_FOR_REMOTE_KVS: nothing
	// of it is prefilled until the answer (Found) comes.
	statusLookup
	// statusDone: ended; it holds nothing and is no longer in the scheduler's maps.
	statusDone
)

func (st status) String() string {
	switch st {
	case statusWaiting:
		return "waiting"
	case statusPrefilling:
		return "prefilling"
	case statusLoading:
		return "loading"
	case statusDecoding:
		return "decoding"
	case statusLookup:
		return "lookup"
	case statusDone:
		return "done"
	}
	return fmt.Sprintf("status(%d)", uint8(st))
}

// statusMoves is every move a task's status may make. Staying put is not a move
// (a decoding task samples token after token).
var statusMoves = map[status][]status{
	statusWaiting:    {statusPrefilling, statusDone},
	statusPrefilling: {statusLoading, statusLookup, statusDecoding, statusDone},
	statusLoading:    {statusPrefilling, statusDone},
	statusLookup:     {statusPrefilling, statusDone},
	statusDecoding:   {statusDone},
}

// setStatus moves t to st, or, when the table has no such move, leaves it and records
// the violation.
func (s *Scheduler) setStatus(t *task, st status) {
	if t.status == st {
		return
	}
	for _, to := range statusMoves[t.status] {
		if to == st {
			t.status = st
			return
		}
	}
	s.check(fmt.Errorf("task %d: no move from %s to %s", t.id, t.status, st))
}

// loading reports whether t waits for the tier's answer: an OpRestore of the pool it
// materializes (restoring), or an OpLoad of its prompt (the other tasks).
func (t *task) loading(restoring bool) bool {
	return t.status == statusLoading && (t.kind == kindMaterialize) == restoring
}
