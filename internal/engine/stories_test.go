package engine

import (
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/polykv/polykv/internal/pool"
)

// TestStories runs the scheduling stories in testdata/stories: scripts of messages to
// the scheduler (driven against the fake backend) and the exact plans, events and state
// they must produce, in the manner of etcd raft's interaction tests. Run with
// -rewrite to regenerate the expected output after an intended change, then read the
// diff.
//
// Commands:
//
//	config nctx=N parallel=N batch=N queue=N pools=N grace=DUR ttl=DUR prefixcache=on
//	submit name=X prompt=1..6;99 [session=S] [max=N] [pool=P] [shared=N] [nocache]
//	pool name=P prompt=... [parent=Q d=N] [pin]   create (or fork) and materialize
//	release|evict|pin|unpin|flush pool=P
//	cancel name=X
//	step [n=N]        plan, decode, commit; prints each batch and what ended
//	run               step until idle; prints what ended
//	advance d=DUR     move the clock
//	state             sessions, pools and cells (checked against the fake cache)
func TestStories(t *testing.T) {
	datadriven.Walk(t, "testdata/stories", func(t *testing.T, path string) {
		st := &story{t: t}
		datadriven.RunTest(t, path, st.do)
	})
}

type story struct {
	t     *testing.T
	h     *harness
	tasks map[string]TaskID
	names map[TaskID]string
	pools map[string]int
	out   strings.Builder
}

func (st *story) printf(format string, args ...any) { fmt.Fprintf(&st.out, format, args...) }

func (st *story) do(t *testing.T, d *datadriven.TestData) string {
	st.out.Reset()
	if d.Cmd != "config" && st.h == nil {
		d.Fatalf(t, "config first")
	}
	switch d.Cmd {
	case "config":
		cfg := Config{NCtx: 512, Parallel: 2, NBatch: 16, MaxQueue: 4, MaxPools: 3, PoolGrace: time.Second, SessionTTL: time.Hour, BytesPerCell: 1}
		for _, a := range d.CmdArgs {
			v := a.Vals[0]
			switch a.Key {
			case "nctx":
				cfg.NCtx = atoi(t, d, v)
			case "parallel":
				cfg.Parallel = atoi(t, d, v)
			case "batch":
				cfg.NBatch = atoi(t, d, v)
			case "queue":
				cfg.MaxQueue = atoi(t, d, v)
			case "pools":
				cfg.MaxPools = atoi(t, d, v)
			case "grace":
				cfg.PoolGrace = dur(t, d, v)
			case "ttl":
				cfg.SessionTTL = dur(t, d, v)
			case "prefixcache":
				cfg.PrefixCache = v == "on"
			default:
				d.Fatalf(t, "unknown config key %s", a.Key)
			}
		}
		st.h = newHarness(t, cfg)
		st.tasks, st.names, st.pools = map[string]TaskID{}, map[TaskID]string{}, map[string]int{}
		return "ok"
	case "submit":
		name := arg(d, "name")
		req := Request{Prompt: tokens(t, d, arg(d, "prompt")), SessionID: arg(d, "session"), MaxTokens: 4}
		if v := arg(d, "max"); v != "" {
			req.MaxTokens = atoi(t, d, v)
		}
		if v := arg(d, "pool"); v != "" {
			req.HasPool, req.PoolID = true, st.poolID(v)
		}
		req.NoPrefixCache = d.HasArg("nocache")
		if v := arg(d, "shared"); v != "" {
			n := atoi(t, d, v)
			req.SharedPrefixN = &n
		}
		id, err := st.h.trySubmit(req)
		if err != nil {
			return fmt.Sprintf("%s: error: %v", name, err)
		}
		st.tasks[name], st.names[id] = id, name
		st.h.collect()
		return name + ": queued"
	case "pool":
		return st.pool(t, d)
	case "release", "evict", "pin", "unpin", "flush":
		id := st.poolID(arg(d, "pool"))
		var err error
		switch d.Cmd {
		case "release":
			err = st.h.releasePool(id)
		case "evict":
			err = st.h.evictPool(id)
		case "pin", "unpin":
			err = st.h.pinPool(id, d.Cmd == "pin")
		case "flush":
			var n, cells int
			n, cells, err = st.h.flushPool(id)
			if err == nil {
				return fmt.Sprintf("flushed %d sessions, %d cells", n, cells)
			}
		}
		if err != nil {
			return "error: " + err.Error()
		}
		return "ok"
	case "cancel":
		st.h.cancel(st.tasks[arg(d, "name")])
		st.h.collect()
		st.ended()
	case "step":
		n := 1
		if v := arg(d, "n"); v != "" {
			n = atoi(t, d, v)
		}
		for range n {
			st.printBatch(st.h.step())
			st.ended()
		}
	case "run":
		for i := 0; !st.h.s.Idle(); i++ {
			if i > 10000 {
				d.Fatalf(t, "not idle after 10000 steps")
			}
			st.h.step()
			st.ended()
		}
		st.h.step() // the last releases
		st.ended()
	case "advance":
		st.h.now = st.h.now.Add(dur(t, d, arg(d, "d")))
		return "ok"
	case "state":
		st.state()
	default:
		d.Fatalf(t, "unknown command %s", d.Cmd)
	}
	if st.out.Len() == 0 {
		return "ok"
	}
	return strings.TrimRight(st.out.String(), "\n")
}

func (st *story) pool(t *testing.T, d *datadriven.TestData) string {
	name := arg(d, "name")
	spec := PoolSpec{Tokens: tokens(t, d, arg(d, "prompt")), Pin: d.HasArg("pin")}
	if v := arg(d, "parent"); v != "" {
		spec.HasParent, spec.Parent, spec.D = true, st.poolID(v), atoi(t, d, arg(d, "d"))
	}
	id, task, err := st.h.tryCreatePool(spec)
	if err != nil {
		return fmt.Sprintf("%s: error: %v", name, err)
	}
	st.pools[name] = id
	st.h.collect()
	for i := 0; task != 0; i++ {
		if ev, ok := st.h.done(task); ok {
			if ev.Err != nil {
				return fmt.Sprintf("%s: materialize failed: %v", name, ev.Err)
			}
			break
		}
		if i > 1000 {
			d.Fatalf(t, "pool %s never materialized", name)
		}
		st.h.step()
	}
	info, _ := st.h.s.Pool(id)
	return fmt.Sprintf("%s: pool %d on seq %d, prefix %d, own %d, %s", name, id, st.h.poolSeq(id), info.PrefixLen, info.OwnLen, info.State)
}

// ended prints the tasks that finished since the last call.
func (st *story) ended() {
	ids := slices.Sorted(maps.Keys(st.h.events)) // task order: map order would vary
	for _, id := range ids {
		evs := st.h.events[id]
		if len(evs) == 0 || !evs[len(evs)-1].Done || st.names[id] == "" {
			continue
		}
		ev := evs[len(evs)-1]
		text := st.h.text(id)
		line := fmt.Sprintf("%s: done %s cache_n=%d prompt_n=%d predicted=%d seq=%d", st.names[id], ev.Finish, ev.Stats.CacheN, ev.Stats.PromptN, ev.Stats.PredictedN, ev.Stats.Seq)
		if ev.Stats.Pool != 0 {
			line += fmt.Sprintf(" pool=%d shared=%d", ev.Stats.Pool, ev.Stats.Shared)
		}
		if ev.Err != nil {
			line += " err=" + ev.Err.Error()
		}
		st.printf("%s text=%s\n", line, text)
		delete(st.names, id) // print once
	}
}

// printBatch prints a batch as runs of consecutive positions per sequence.
func (st *story) printBatch(b []BatchEntry) {
	if len(b) == 0 {
		st.printf("batch: empty\n")
		return
	}
	var parts []string
	for i := 0; i < len(b); {
		j := i
		for j+1 < len(b) && b[j+1].Seq == b[i].Seq && b[j+1].Pos == b[j].Pos+1 {
			j++
		}
		p := fmt.Sprintf("seq%d@%d", b[i].Seq, b[i].Pos)
		if j > i {
			p = fmt.Sprintf("seq%d@%d..%d", b[i].Seq, b[i].Pos, b[j].Pos)
		}
		if b[j].Sample {
			p += "*"
		}
		parts = append(parts, p)
		i = j + 1
	}
	st.printf("batch: %s\n", strings.Join(parts, " "))
}

func (st *story) state() {
	s := st.h.s
	var sessions []string
	for name, sl := range s.bySession {
		sessions = append(sessions, fmt.Sprintf("%s→seq%d", name, sl.seq))
	}
	slices.Sort(sessions)
	st.printf("sessions: %s\n", strings.Join(sessions, " "))
	for _, sl := range s.slots {
		if len(sl.tokens) == 0 && sl.session == "" && sl.task == nil {
			continue
		}
		line := fmt.Sprintf("seq%d: session=%q tokens=%d", sl.seq, sl.session, len(sl.tokens))
		if sl.base != nil {
			line += fmt.Sprintf(" pool=%d shared=%d", sl.base.ID, sl.shared)
		}
		if own := s.own(sl); own != len(sl.tokens)-sl.shared {
			line += fmt.Sprintf(" own=%d", own) // it shares cells beyond a pool's
		}
		if sl.task != nil {
			line += " busy"
		} else if sl.session == "" {
			line += " cached"
		}
		st.printf("%s\n", line)
	}
	for _, p := range s.pools.All() {
		st.printf("pool %d: seq%d %s prefix=%d own=%d sessions=%d children=%v pinned=%v\n", p.ID, p.Seq, p.State, p.L(), s.poolOwn(p), p.Sessions, pool.ChildIDs(p), p.Pinned())
	}
	apply(st.h.be, Plan{Samplers: s.samplers, SeqOps: s.ops}) // what the next step would do first
	s.samplers, s.ops = nil, nil
	st.h.checkAccounting()
	u := s.Usage()
	st.printf("cells: %d of %d; running %d, waiting %d\n", st.h.be.cells(), u.CellsMax, u.Running, u.Waiting)
	if s.cfg.PrefixCache {
		st.printf("prefix cache: hit tokens %d, cached cells %d, evictions %d\n", u.CacheHitTokens, u.CacheCells, u.CacheEvictions)
	}
}

func (st *story) poolID(name string) int {
	if id, ok := st.pools[name]; ok {
		return id
	}
	n, err := strconv.Atoi(name) // a literal id (stale, or never created)
	if err != nil {
		st.t.Fatalf("unknown pool %q", name)
	}
	return n
}

func arg(d *datadriven.TestData, key string) string {
	for _, a := range d.CmdArgs {
		if a.Key == key && len(a.Vals) > 0 {
			return a.Vals[0]
		}
	}
	return ""
}

func atoi(t *testing.T, d *datadriven.TestData, v string) int {
	n, err := strconv.Atoi(v)
	if err != nil {
		d.Fatalf(t, "bad number %q", v)
	}
	return n
}

func dur(t *testing.T, d *datadriven.TestData, v string) time.Duration {
	x, err := time.ParseDuration(v)
	if err != nil {
		d.Fatalf(t, "bad duration %q", v)
	}
	return x
}

// tokens parses "1..6;99": inclusive ranges and single ids.
func tokens(t *testing.T, d *datadriven.TestData, spec string) []Token {
	var out []Token
	for _, part := range strings.Split(spec, ";") {
		if part == "" {
			continue
		}
		if a, b, ok := strings.Cut(part, ".."); ok {
			for i := atoi(t, d, a); i <= atoi(t, d, b); i++ {
				out = append(out, Token(i))
			}
		} else {
			out = append(out, Token(atoi(t, d, part)))
		}
	}
	return out
}
