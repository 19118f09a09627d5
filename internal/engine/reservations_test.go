package engine

import (
	"errors"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/admission"
)

// fanoutPolicy is a pool whose floor allows exactly two sessions: two are guaranteed,
// and the floor is one nobody reaches.
func fanoutPolicy() admission.Policy {
	p := admission.DefaultPolicy()
	p.Mode, p.TargetTPS, p.GuaranteeMinSessions = admission.ModeEnforced, 1e9, 2
	p.SettleTokens = 10
	return p
}

func (h *harness) reserve(id int, ttl time.Duration) ReservationReport {
	h.t.Helper()
	r, err := h.tryReserve(id, ttl, 0)
	if err != nil {
		h.t.Fatal(err)
	}
	return r
}

// The fan-out: six branches ask in the same step. Read-only verdicts all say
// "guaranteed minimum"; reservations grant exactly the two the policy allows.
func TestReservationsCannotOvershootAFanOut(t *testing.T) {
	h, id, prefix := admissionHarness(t, fanoutPolicy())
	for range 6 {
		if c := h.capacity(id); !c.CanAdmit {
			t.Fatalf("a read-only verdict of an empty pool should admit: %+v", c.Verdict)
		}
	}
	var granted []string
	for i := range 6 {
		r := h.reserve(id, 0)
		if r.Granted != (r.ReservationID != nil) {
			t.Fatalf("reservation %d: granted %v with id %v", i, r.Granted, r.ReservationID)
		}
		if r.Granted {
			granted = append(granted, *r.ReservationID)
		} else if r.Verdict.Reason != admission.ReasonSettling {
			t.Fatalf("reservation %d refused for %q, want settling (two warming reservations)", i, r.Verdict.Reason)
		}
	}
	if len(granted) != 2 {
		t.Fatalf("granted %d reservations, the policy allows 2", len(granted))
	}
	c := h.capacity(id)
	if c.CanAdmit || c.NReserved != 2 || c.NPoolSessions != 2 || c.NWarming != 2 {
		t.Fatalf("with two reservations outstanding: %+v", c.Verdict)
	}
	// A branch without a reservation is held by the enforced gate (settling).
	_, g, err := h.submitGated(agentReq(prefix, id, "x", 5))
	if err != nil || !g.Held {
		t.Fatalf("unreserved branch: %v %+v", err, g)
	}
	h.collect()
	// The two reserved branches pass the gate on their reservation.
	var tasks []TaskID
	for i, rid := range granted {
		req := agentReq(prefix, id, "r"+string(rune('a'+i)), 30)
		req.ReservationID = rid
		tid, g, err := h.submitGated(req)
		if err != nil || g.Held || !g.Reserved {
			t.Fatalf("reserved branch %d: %v %+v", i, err, g)
		}
		tasks = append(tasks, tid)
	}
	h.collect()
	if c := h.capacity(id); c.NReserved != 0 || c.NPoolSessions != 2 {
		t.Fatalf("used reservations still counted, or their sessions not: %+v", c.Verdict)
	}
	// A used reservation cannot be used twice: the request goes through the gate.
	again := agentReq(prefix, id, "dup", 5)
	again.ReservationID = granted[0]
	if _, g, err := h.submitGated(again); (err == nil && !g.Held) || g.Reserved {
		t.Fatalf("reused reservation passed: %v %+v", err, g)
	}
	h.collect()
	h.run()
	for _, tid := range tasks {
		if ev, ok := h.done(tid); !ok || ev.Err != nil || ev.Stats.PredictedN != 30 {
			t.Fatalf("reserved branch did not run: %+v", ev)
		}
	}
}

func TestReservationExpiryAndRelease(t *testing.T) {
	h, id, prefix := admissionHarness(t, fanoutPolicy())
	a := h.reserve(id, 100*time.Millisecond)
	b := h.reserve(id, time.Minute)
	if !a.Granted || !b.Granted || h.reserve(id, 0).Granted {
		t.Fatal("want two grants, then a refusal")
	}
	// Expiry is judged from the scheduler's now: advance it past a's ttl.
	h.now = h.now.Add(200 * time.Millisecond)
	if c := h.capacity(id); c.NReserved != 1 || !c.CanAdmit {
		t.Fatalf("after a expired: %+v", c.Verdict)
	}
	// An expired reservation no longer admits: the request is gated like any other.
	req := agentReq(prefix, id, "late", 5)
	req.ReservationID = *a.ReservationID
	if _, g, _ := h.submitGated(req); g.Reserved {
		t.Fatal("an expired reservation was used")
	}
	h.collect()
	if err := h.releaseReservation(id, *b.ReservationID); err != nil {
		t.Fatal(err)
	}
	if err := h.releaseReservation(id, *b.ReservationID); !errors.Is(err, ErrReservationNotFound) {
		t.Fatalf("second release: %v", err)
	}
	if c := h.capacity(id); c.NReserved != 0 {
		t.Fatalf("released reservation still counted: %+v", c.Verdict)
	}
	if _, err := h.tryReserve(id, 11*time.Minute, 0); err == nil {
		t.Fatal("a ttl over the maximum was accepted")
	}
	if _, err := h.tryReserve(999, 0, 0); err == nil {
		t.Fatal("a reservation on an unknown pool was accepted")
	}
}

// A reservation also takes its cells out of the pool's KV headroom, so a fan-out
// cannot reserve more context than the cache has.
func TestReservationsTakeCells(t *testing.T) {
	p := admission.DefaultPolicy()
	p.GuaranteeMinSessions = 0 // only the KV arm decides
	h, id, _ := admissionHarness(t, p)
	free := h.capacity(id).FreeCells
	n := 0
	for range 100 {
		r, err := h.tryReserve(id, 0, 1000)
		if err != nil {
			t.Fatal(err)
		}
		if !r.Granted {
			if r.Verdict.Reason != admission.ReasonContext && r.Verdict.Reason != admission.ReasonSettling {
				t.Fatalf("refused for %q", r.Verdict.Reason)
			}
			break
		}
		n++
	}
	if n == 0 || n > free/1000 {
		t.Fatalf("granted %d reservations of 1000 tokens with %d free cells", n, free)
	}
}

// Issue 13: an idle neighbour holding most of the cache, and a released pool in its
// grace period, must not push a small session's own pressure up.
func TestSessionPressureIsPerSession(t *testing.T) {
	cfg := poolCfg() // 1024 cells, pool grace 1 s
	h := newHarness(t, cfg)
	big := h.submit(Request{Prompt: seqTokens(1, 900), SessionID: "big", MaxTokens: 1})
	h.run()
	small := h.submit(Request{Prompt: seqTokens(2000, 20), SessionID: "small", MaxTokens: 4})
	h.run()
	if _, ok := h.done(big); !ok {
		t.Fatal("big did not finish")
	}
	ev, ok := h.done(small)
	if !ok || ev.Err != nil {
		t.Fatalf("small: %+v", ev)
	}
	// The finished event carries the session's own context.
	if ev.Stats.Ctx.CtxUsed < 20 || ev.Stats.Ctx.CtxUsed > 24 || ev.Stats.Ctx.CtxPressure <= 0 || ev.Stats.Ctx.CtxPressure > 0.05 {
		t.Fatalf("small's context at its end: %+v", ev.Stats.Ctx)
	}
	if h.s.pressure() < 0.85 {
		t.Fatalf("server-wide pressure %f, the neighbour should dominate it", h.s.pressure())
	}
	ctxOf := func(session string) SessionTPS {
		for _, st := range h.s.TPS(h.now).Sessions {
			if st.SessionID == session {
				return st
			}
		}
		t.Fatalf("session %q not in /polykv/tps: %+v", session, h.s.TPS(h.now).Sessions)
		return SessionTPS{}
	}
	before := ctxOf("small").CtxPressure
	if before > 0.05 {
		t.Fatalf("small's own pressure %f with an idle neighbour (server-wide %f)", before, h.s.pressure())
	}
	// A running neighbour's cells are not free: pressure rises while it runs.
	h.submit(Request{Prompt: seqTokens(3000, 400), MaxTokens: 50})
	h.steps(30)
	if busy := ctxOf("small").CtxPressure; busy < 1.5*before {
		t.Fatalf("small's pressure %f beside a running 400-token neighbour, %f before", busy, before)
	}
	h.run()
	// A released pool in its grace period holds cells that will be reclaimed: free.
	pid := h.createPool(PoolSpec{Tokens: seqTokens(5000, 500)})
	if err := h.releasePool(pid); err != nil {
		t.Fatal(err)
	}
	if _, err := h.s.Pool(pid); err != nil {
		t.Fatalf("the released pool should still be in its grace period: %v", err)
	}
	if got := ctxOf("small").CtxPressure; got != before {
		t.Fatalf("small's pressure %f with a released pool in grace, %f before", got, before)
	}
	// /capacity?session_id= reports it too.
	root := h.createPool(PoolSpec{Tokens: seqTokens(7000, 10)})
	c, err := h.capacityOf(root, 0, "small")
	if err != nil || c.Session == nil || c.SessionPressure == nil || *c.SessionPressure != c.Session.CtxPressure || c.Session.CtxUsed != ev.Stats.Ctx.CtxUsed {
		t.Fatalf("capacity with session_id: %v %+v", err, c)
	}
	if c.Session.PoolID != nil {
		t.Fatalf("small is on no pool, reported %v", *c.Session.PoolID)
	}
	if c2, _ := h.capacityOf(root, 0, "nobody"); c2.Session != nil {
		t.Fatal("an unknown session got a context report")
	}
	for _, sl := range h.s.Slots() {
		if sl.SessionID == "small" && sl.Pressure != c.Session.CtxPressure {
			t.Fatalf("/slots pressure %f, capacity %f", sl.Pressure, c.Session.CtxPressure)
		}
	}
}
