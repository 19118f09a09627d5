package engine

import (
	"cmp"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/polykv/polykv/internal/admission"
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
//	config nctx=N parallel=N batch=N queue=N pools=N grace=DUR ttl=DUR [cost=perdecode] [prefixcache=on] [queuetimeout=DUR] [attachmin=N] [tier=on]
//	       [spec=TYPES draftmax=N draftmin=N stepcost=F] [repeat=N]
//	                  spec: speculative decoding with these drafters (comma-separated);
//	                  stepcost: Spec.StepCost (-1: no cost-aware draft limit);
//	                  repeat: the fake model mostly repeats the token N back (fakeRepeater)
//	submit name=X prompt=1..6;99 [session=S] [max=N] [pool=P | poolkey=P] [shared=N] [reservation=R] [overcommit] [nocache]
//	                  poolkey: name pool P by its content key (prefix hash), as a router does
//	pool name=P prompt=... [parent=Q d=N] [pin] [prefilled] [nowait]   create (or fork)
//	                  and materialize; prefilled: also print how many tokens were
//	                  prefilled; nowait: return at once, the materialization is task P
//	release|evict|pin|unpin|flush pool=P
//	cancel name=X
//	step [n=N]        plan, decode, commit; prints each batch (drafts as seqS@P..Q?) and what ended
//	run               step until idle; prints what ended
//	advance d=DUR     move the clock
//	state             sessions, pools and cells (checked against the fake cache)
//	waiting           the requests without a sequence yet: why they wait, for how long
//	admission pool=P [mode=M] [on=S] [floor=F] [guarantee=N] [settle_tokens=N] [settle_ms=N] [queue_ms=N]
//	          [throttle=off|toward_floor] [margin=F] [maxskip=F]
//	tps               each session's experienced tps, warming, and steps skipped by a throttle
//	capacity pool=P [expected=N] [session=S]   the admission verdict now
//	reserve name=R pool=P [ttl=DUR] [expected=N]
//	unreserve name=R pool=P
//
// cost=perdecode makes a step cost 10 ms per sampled token (see perDecodeCost), so
// per-session tps falls as sessions join and admission has something to measure;
// cost=affine makes it 5 ms plus 10 ms per sampled token plus 1 ms per other prompt
// token (affineCost): a fixed part per step, as on a real machine.
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
	rsv   map[string]string // reservation name → id
	// nended is how many of the harness's ended tasks were printed.
	nended int
	out    strings.Builder
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
			case "cost":
				if v != "perdecode" && v != "affine" {
					d.Fatalf(t, "unknown cost %s", v)
				}
			case "prefixcache":
				cfg.PrefixCache = v == "on"
			case "attachmin":
				cfg.AttachMin = atoi(t, d, v)
			case "queuetimeout":
				cfg.QueueTimeout = dur(t, d, v)
			case "recurrent":
				cfg.Recurrent = v == "on"
			case "tier":
				cfg.Tier = v == "on" // a tier below the cache (the fake backend's)
			case "spec":
				types, err := ParseSpecTypes(v)
				if err != nil {
					d.Fatalf(t, "%v", err)
				}
				cfg.Spec.Types = types
			case "draftmax":
				cfg.Spec.DraftMax = atoi(t, d, v)
			case "draftmin":
				cfg.Spec.DraftMin = atoi(t, d, v)
			case "stepcost":
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					d.Fatalf(t, "stepcost: %v", err)
				}
				cfg.Spec.StepCost = f
			case "repeat":
			default:
				d.Fatalf(t, "unknown config key %s", a.Key)
			}
		}
		st.h, st.nended = newHarness(t, cfg), 0 // a new harness: its ended list starts empty
		switch arg(d, "cost") {
		case "perdecode":
			st.h.stepCost = perDecodeCost
		case "affine":
			st.h.stepCost = affineCost
		}
		if v := arg(d, "repeat"); v != "" {
			st.h.be.model = fakeRepeater(atoi(t, d, v))
		}
		st.tasks, st.names, st.pools, st.rsv = map[string]TaskID{}, map[TaskID]string{}, map[string]int{}, map[string]string{}
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
		if v := arg(d, "poolkey"); v != "" {
			info, err := st.h.s.Pool(st.poolID(v))
			if err != nil {
				d.Fatalf(t, "poolkey: %v", err)
			}
			key := pool.RollingHash(info.Tokens)[len(info.Tokens)-1]
			req.PoolKey = &key
		}
		req.NoPrefixCache = d.HasArg("nocache")
		if v := arg(d, "shared"); v != "" {
			n := atoi(t, d, v)
			req.SharedPrefixN = &n
		}
		if v := arg(d, "reservation"); v != "" {
			req.ReservationID = st.rsv[v]
			if req.ReservationID == "" {
				req.ReservationID = v // a literal id (unknown, or never granted)
			}
		}
		req.Overcommit = d.HasArg("overcommit")
		id, g, err := st.h.submitGated(req)
		if err != nil {
			return fmt.Sprintf("%s: error: %v", name, err)
		}
		st.tasks[name], st.names[id] = id, name
		st.h.collect()
		switch {
		case g.Reserved:
			return name + ": queued (reservation used)"
		case g.Held:
			return fmt.Sprintf("%s: held (%s)", name, g.Verdict.Reason)
		case g.Warned:
			return fmt.Sprintf("%s: queued over the policy (%s)", name, g.Verdict.Reason)
		case g.Checked:
			return fmt.Sprintf("%s: queued (%s)", name, g.Verdict.Reason)
		}
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
	case "waiting":
		for _, w := range st.h.s.Waiting(st.h.now) {
			line := fmt.Sprintf("%s: %s for %s", st.names[TaskID(w.Task)], w.Reason, w.Waited)
			if w.PoolID != nil {
				line += fmt.Sprintf(" (pool %d)", *w.PoolID)
			}
			st.printf("%s\n", line)
		}
	case "admission", "capacity", "reserve", "unreserve":
		return st.admission(t, d)
	case "tps":
		snap := st.h.s.TPS(st.h.now)
		st.printf("mean_active_tps=%.1f active=%d warming=%d throttled_total=%d\n", snap.MeanActiveTPS, snap.NActive, snap.NWarming, snap.ThrottledSteps)
		for _, ss := range snap.Sessions {
			if ss.State != "decode" {
				continue
			}
			st.printf("%s: %.1f tok/s warming=%v decoded=%d throttled=%d\n", ss.SessionID, ss.TPSEWMA, ss.Warming, ss.Decoded, ss.ThrottledSteps)
		}
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
	if d.HasArg("nowait") {
		if task == 0 {
			return fmt.Sprintf("%s: pool %d resident at once", name, id)
		}
		st.tasks[name], st.names[task] = task, name
		return fmt.Sprintf("%s: pool %d materializing", name, id)
	}
	prefilled := 0
	for i := 0; task != 0; i++ {
		if ev, ok := st.h.done(task); ok {
			if ev.Err != nil {
				return fmt.Sprintf("%s: materialize failed: %v", name, ev.Err)
			}
			prefilled = ev.Stats.PromptN
			break
		}
		if i > 1000 {
			d.Fatalf(t, "pool %s never materialized", name)
		}
		st.h.step()
	}
	info, _ := st.h.s.Pool(id)
	line := fmt.Sprintf("%s: pool %d on seq %d, prefix %d, own %d, %s", name, id, st.h.poolSeq(id), info.PrefixLen, info.OwnLen, info.State)
	if d.HasArg("prefilled") {
		line += fmt.Sprintf(", prefilled %d", prefilled)
	}
	return line
}

// admission runs the admission commands.
func (st *story) admission(t *testing.T, d *datadriven.TestData) string {
	id := st.poolID(arg(d, "pool"))
	num := func(key string) int {
		if v := arg(d, key); v != "" {
			return atoi(t, d, v)
		}
		return 0
	}
	switch d.Cmd {
	case "admission":
		var pt admission.Patch
		if v := arg(d, "mode"); v != "" {
			pt.Mode = &v
		}
		if v := arg(d, "on"); v != "" {
			pt.OnSaturation = &v
		}
		if v := arg(d, "floor"); v != "" {
			f, err := strconv.ParseFloat(v, 64)
			if err != nil {
				d.Fatalf(t, "bad floor %q", v)
			}
			pt.TargetTPS = &f
		}
		if v := arg(d, "guarantee"); v != "" {
			n := atoi(t, d, v)
			pt.GuaranteeMinSessions = &n
		}
		for key, dst := range map[string]**int64{"settle_ms": &pt.SettleMaxMs, "queue_ms": &pt.QueueTimeoutMs} {
			if v := arg(d, key); v != "" {
				n := int64(atoi(t, d, v))
				*dst = &n
			}
		}
		if v := arg(d, "settle_tokens"); v != "" {
			n := atoi(t, d, v)
			pt.SettleTokens = &n
		}
		if v := arg(d, "throttle"); v != "" {
			pt.Throttle = &v
		}
		for key, dst := range map[string]**float64{"margin": &pt.ThrottleMargin, "maxskip": &pt.ThrottleMaxSkip} {
			if v := arg(d, key); v != "" {
				f, err := strconv.ParseFloat(v, 64)
				if err != nil {
					d.Fatalf(t, "bad %s %q", key, v)
				}
				*dst = &f
			}
		}
		r := st.h.send(SetAdmission{Pool: id, Patch: pt})
		if r.Err != nil {
			return "error: " + r.Err.Error()
		}
		p := r.Admission
		line := fmt.Sprintf("%s on_saturation=%s floor=%g guarantee=%d settle_tokens=%d settle_ms=%d queue_ms=%d",
			p.Mode, p.OnSaturation, p.TargetTPS, p.GuaranteeMinSessions, p.SettleTokens, p.SettleMaxMs, p.QueueTimeoutMs)
		if p.Throttle != admission.ThrottleOff {
			line += fmt.Sprintf(" throttle=%s margin=%g maxskip=%g", p.Throttle, p.ThrottleMargin, p.ThrottleMaxSkip)
		}
		return line
	case "capacity":
		c, err := st.h.capacityOf(id, num("expected"), arg(d, "session"))
		if err != nil {
			return "error: " + err.Error()
		}
		return verdictLine(c.Verdict)
	case "reserve":
		rep, err := st.h.tryReserve(id, dur(t, d, cmp.Or(arg(d, "ttl"), "0s")), num("expected"))
		if err != nil {
			return "error: " + err.Error()
		}
		if !rep.Granted {
			return "refused: " + verdictLine(rep.Verdict)
		}
		st.rsv[arg(d, "name")] = *rep.ReservationID
		return fmt.Sprintf("granted %s expires_in_ms=%d", *rep.ReservationID, rep.ExpiresInMs)
	case "unreserve":
		rid := cmp.Or(st.rsv[arg(d, "name")], arg(d, "name"))
		if err := st.h.send(ReleaseReservation{Pool: id, ID: rid}).Err; err != nil {
			return "error: " + err.Error()
		}
		return "ok"
	}
	return ""
}

// verdictLine prints the parts of a verdict a story checks, in a fixed order.
func verdictLine(v admission.Verdict) string {
	f := func(p *float64) string {
		if p == nil {
			return "-"
		}
		return strconv.FormatFloat(*p, 'f', 1, 64)
	}
	line := fmt.Sprintf("can_admit=%v reason=%q sessions=%d warming=%d active=%d reserved=%d free=%d mean=%s projected=%s drop=%s",
		v.CanAdmit, v.Reason, v.NPoolSessions, v.NWarming, v.NActive, v.NReserved, v.FreeCells,
		f(v.MeanActiveTPS), f(v.ProjectedIfAdmitted), f(v.DropPerAdmitEWMA))
	if v.Settling {
		line += fmt.Sprintf(" settling=%dms", v.SettleRemainingMs)
	}
	if !v.CanAdmit {
		line += fmt.Sprintf(" retry_after=%ds", v.RetryAfterS)
	}
	return line
}

// ended prints the tasks that finished since the last call, in the order they ended
// (not in map order: that made stories where two tasks end in one step flaky).
func (st *story) ended() {
	for ; st.nended < len(st.h.ended); st.nended++ {
		id := st.h.ended[st.nended]
		if st.names[id] == "" {
			continue
		}
		evs := st.h.events[id]
		ev := evs[len(evs)-1]
		text := st.h.text(id)
		line := fmt.Sprintf("%s: done %s cache_n=%d prompt_n=%d predicted=%d seq=%d", st.names[id], ev.Finish, ev.Stats.CacheN, ev.Stats.PromptN, ev.Stats.PredictedN, ev.Stats.Seq)
		if ev.Stats.Pool != 0 {
			line += fmt.Sprintf(" pool=%d shared=%d", ev.Stats.Pool, ev.Stats.Shared)
		}
		if ev.Stats.DraftN != 0 {
			line += fmt.Sprintf(" drafted=%d accepted=%d", ev.Stats.DraftN, ev.Stats.DraftAccepted)
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
		for j+1 < len(b) && b[j+1].Seq == b[i].Seq && b[j+1].Pos == b[j].Pos+1 && b[j+1].Draft == b[i].Draft {
			j++
		}
		p := fmt.Sprintf("seq%d@%d", b[i].Seq, b[i].Pos)
		if j > i {
			p = fmt.Sprintf("seq%d@%d..%d", b[i].Seq, b[i].Pos, b[j].Pos)
		}
		switch {
		case b[i].Draft:
			p += "?" // speculative drafts, each sampled while the earlier ones hold
		case b[j].Sample:
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
		if own := s.kv.Owned(sl.seq); own != len(sl.tokens)-sl.shared {
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
		st.printf("pool %d: seq%d %s prefix=%d own=%d sessions=%d children=%v pinned=%v\n", p.ID, p.Seq, p.State, p.L(), p.OwnCells(), p.Sessions, pool.ChildIDs(p), p.Pinned())
	}
	apply(st.h.be, Plan{Samplers: s.samplers, SeqOps: s.ops}) // what the next step would do first
	s.samplers, s.ops = nil, nil
	st.h.checkAccounting()
	u := s.Usage()
	st.printf("cells: %d of %d; running %d, waiting %d", st.h.be.cells(), u.CellsMax, u.Running, u.Waiting)
	if n := s.adm.Held(); n > 0 {
		st.printf(", held %d", n) // by an enforced pool's gate
	}
	st.printf("\n")
	if s.cfg.PrefixCache {
		st.printf("prefix cache: hit tokens %d, cached cells %d, evictions %d (sessions %d, pools %d)\n", u.CacheHitTokens, u.CacheCells, u.CacheEvictions, u.SessionEvictions, u.PoolEvictions)
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
