package engine

import (
	"context"
	"errors"
	"sync"
	"testing"
	"time"
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

func startEngine(t *testing.T, cfg Config) (*Engine, *lockedBackend) {
	t.Helper()
	s, err := NewScheduler(cfg, fakeVocab{})
	if err != nil {
		t.Fatal(err)
	}
	be := &lockedBackend{f: newFakeBackend(t, cfg.NCtx)}
	e := New(s, be)
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
			st, err := e.Submit(context.Background(), Request{Prompt: seqTokens(5, 6), MaxTokens: 12})
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
	if err := e.Inspect(context.Background(), func(*Scheduler) {}); err != nil {
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
	st, err := e.Submit(context.Background(), Request{Prompt: seqTokens(1, 4)})
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
	st2, err := e.Submit(context.Background(), Request{Prompt: seqTokens(9, 4), MaxTokens: 3})
	if err != nil {
		t.Fatal(err)
	}
	if _, ev := drain(t, st2); ev.Err != nil || ev.Stats.PredictedN != 3 {
		t.Fatalf("second request: %+v", ev)
	}
	var slots []SlotInfo
	if err := e.Inspect(context.Background(), func(s *Scheduler) { slots = s.Slots() }); err != nil {
		t.Fatal(err)
	}
	be.mu.Lock()
	defer be.mu.Unlock()
	if len(slots) != 0 || be.f.cells() != 0 || len(be.f.samplers) != 0 {
		t.Fatalf("leak after cancel: slots %v cells %d samplers %d", slots, be.f.cells(), len(be.f.samplers))
	}
}

func TestEngineClose(t *testing.T) {
	s, _ := NewScheduler(Config{NCtx: 1024, Parallel: 1, NBatch: 8, MaxQueue: 1}, fakeVocab{})
	e := New(s, &lockedBackend{f: newFakeBackend(t, 1024)})
	e.Close()
	if _, err := e.Submit(context.Background(), Request{Prompt: seqTokens(1, 3)}); !errors.Is(err, ErrEngineClosed) {
		t.Fatalf("submit after close: %v", err)
	}
}
