package engine

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/polykv/polykv/internal/pool"
)

// lockedBackend lets the test read the fake's state while the engine goroutine runs.
type lockedBackend struct {
	mu sync.Mutex
	f  *fakeBackend
}

func (l *lockedBackend) Decode(b []BatchEntry) ([]Sampled, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.Decode(b)
}
func (l *lockedBackend) SeqRm(s, p0, p1 int) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return l.f.SeqRm(s, p0, p1)
}
func (l *lockedBackend) SeqCp(a, b, p0, p1 int) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.f.SeqCp(a, b, p0, p1)
}
func (l *lockedBackend) NewSampler(id TaskID, p SamplingParams, lp bool, h []Token) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.f.NewSampler(id, p, lp, h)
}
func (l *lockedBackend) FreeSampler(id TaskID) { l.mu.Lock(); defer l.mu.Unlock(); l.f.FreeSampler(id) }

// Caps implements Backend: the locked fake declares no ability beyond Backend but, when
// the fake's slots is set, its slots and cell probe (under the lock).
func (l *lockedBackend) Caps() Caps {
	l.mu.Lock()
	defer l.mu.Unlock()
	if l.f.slots {
		return Caps{Slots: lockedSlots{l}, Probe: lockedSlots{l}}
	}
	return Caps{}
}

// lockedSlots is the locked fake's SlotBackend and CellProber.
type lockedSlots struct{ l *lockedBackend }

func (x lockedSlots) SaveSeq(seq int) ([]byte, error) {
	x.l.mu.Lock()
	defer x.l.mu.Unlock()
	return x.l.f.SaveSeq(seq)
}

func (x lockedSlots) LoadSeq(seq, n int, data []byte) error {
	x.l.mu.Lock()
	defer x.l.mu.Unlock()
	return x.l.f.LoadSeq(seq, n, data)
}

func (x lockedSlots) ProbeFits(seq, n int, tok Token) (bool, error) {
	x.l.mu.Lock()
	defer x.l.mu.Unlock()
	return x.l.f.ProbeFits(seq, n, tok)
}

func startEngine(t *testing.T, cfg Config) (*Engine, *lockedBackend) {
	t.Helper()
	s, err := NewScheduler(cfg, fakeVocab{})
	if err != nil {
		t.Fatal(err)
	}
	be := &lockedBackend{f: newFakeBackend(t, cfg.NCtx)}
	e := New(s, be, nil)
	t.Cleanup(e.Close)
	return e, be
}

func drain(t *testing.T, st *Stream) (string, Event) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	text := ""
	for {
		ev, ok, err := st.Next(ctx)
		if err != nil {
			t.Fatalf("stream: %v", err)
		}
		if !ok {
			t.Fatal("stream ended without a Done event")
		}
		text += ev.Text
		if ev.Done {
			return text, ev
		}
	}
}

func TestEngineConcurrentStreams(t *testing.T) {
	e, be := startEngine(t, Config{NCtx: 1024, Parallel: 4, NBatch: 32, MaxQueue: 8})
	want := expectedText(t, seqTokens(5, 6), 12)
	var wg sync.WaitGroup
	for i := 0; i < 8; i++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			st, _, err := e.Submit(context.Background(), Request{Prompt: seqTokens(5, 6), MaxTokens: 12})
			if err != nil {
				t.Errorf("submit: %v", err)
				return
			}
			text, ev := drain(t, st)
			if text != want || ev.Stats.PredictedN != 12 {
				t.Errorf("stream text %q (%d tokens), want %q", text, ev.Stats.PredictedN, want)
			}
		}()
	}
	wg.Wait()
	var cells int
	// A round trip through the engine: every earlier message has been handled.
	if _, err := e.Send(context.Background(), Tick{}); err != nil {
		t.Fatal(err)
	}
	be.mu.Lock()
	cells = be.f.cells()
	be.mu.Unlock()
	if cells != 0 {
		t.Fatalf("%d cells left after anonymous requests", cells)
	}
}

func TestEngineContextCancelFreesSequence(t *testing.T) {
	e, be := startEngine(t, Config{NCtx: 1024, Parallel: 1, NBatch: 8, MaxQueue: 1})
	st, _, err := e.Submit(context.Background(), Request{Prompt: seqTokens(1, 4)})
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	if _, _, err := st.Next(ctx); err != nil {
		t.Fatal(err)
	}
	cancel() // the client went away: buffered events may still come, then the error
	for {
		ev, _, err := st.Next(ctx)
		if errors.Is(err, context.Canceled) || ev.Finish == FinishCancelled {
			break
		}
		if err != nil || ev.Done {
			t.Fatalf("Next after cancel: %+v %v", ev, err)
		}
	}
	// The next request gets the only sequence, so the cancelled one was released.
	st2, _, err := e.Submit(context.Background(), Request{Prompt: seqTokens(9, 4), MaxTokens: 3})
	if err != nil {
		t.Fatal(err)
	}
	if _, ev := drain(t, st2); ev.Err != nil || ev.Stats.PredictedN != 3 {
		t.Fatalf("second request: %+v", ev)
	}
	if _, err := e.Send(context.Background(), Tick{}); err != nil {
		t.Fatal(err)
	}
	slots := e.Snapshot().Slots // published after the message
	be.mu.Lock()
	defer be.mu.Unlock()
	if len(slots) != 0 || be.f.cells() != 0 || len(be.f.samplers) != 0 {
		t.Fatalf("leak after cancel: slots %v cells %d samplers %d", slots, be.f.cells(), len(be.f.samplers))
	}
}

func TestEngineClose(t *testing.T) {
	s, _ := NewScheduler(Config{NCtx: 1024, Parallel: 1, NBatch: 8, MaxQueue: 1}, fakeVocab{})
	e := New(s, &lockedBackend{f: newFakeBackend(t, 1024)}, nil)
	e.Close()
	if _, _, err := e.Submit(context.Background(), Request{Prompt: seqTokens(1, 3)}); !errors.Is(err, ErrEngineClosed) {
		t.Fatalf("submit after close: %v", err)
	}
}

// The HTTP layer reads snapshots instead of reaching into the engine: a command's
// effect, and a finished request, must already be visible when the reply arrives.
func TestSnapshotShowsACommandsEffectOnReply(t *testing.T) {
	e, _ := startEngine(t, Config{NCtx: 1024, Parallel: 2, MaxPools: 2, NBatch: 16, MaxQueue: 4, PoolGrace: time.Hour})
	ctx := context.Background()
	id, _, err := e.CreatePool(ctx, PoolSpec{Tokens: seqTokens(1, 40)})
	if err != nil {
		t.Fatal(err)
	}
	if info, err := e.Snapshot().Pool(id); err != nil || info.State != "resident" || len(info.Tokens) != 40 {
		t.Fatalf("snapshot after create: %+v %v", info, err)
	}
	if res, err := e.Send(ctx, PinPool{Pool: id, Pin: true}); err != nil || res.Err != nil {
		t.Fatalf("pin: %v %v", err, res.Err)
	}
	if info, _ := e.Snapshot().Pool(id); !info.UserPinned {
		t.Fatal("snapshot after pin does not show the pin")
	}
	st, _, err := e.Submit(ctx, Request{Prompt: append(seqTokens(1, 40), 7), HasPool: true, PoolID: id, SessionID: "s", MaxTokens: 3})
	if err != nil {
		t.Fatal(err)
	}
	if _, ev := drain(t, st); ev.Err != nil {
		t.Fatal(ev.Err)
	}
	snap := e.Snapshot()
	if len(snap.Slots) != 1 || snap.Slots[0].State != "idle" || snap.Usage.Running != 0 {
		t.Fatalf("snapshot after the request ended: slots %+v usage %+v", snap.Slots, snap.Usage)
	}
	if res, err := e.Send(ctx, PinPool{Pool: 999}); err != nil || !errors.Is(res.Err, pool.ErrNotFound) {
		t.Fatalf("pin of an unknown pool: %v %v", err, res.Err)
	}
	if _, err := e.Send(ctx, Submit{}); err == nil {
		t.Fatal("Send accepted a Submit, which needs a stream")
	}
}
