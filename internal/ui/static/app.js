// PolyKV dashboard: plain JS, no dependencies. Reads the server's public routes with the
// operator's API key (kept in localStorage), streams /polykv/tps through fetch() (an
// EventSource cannot send an Authorization header) and falls back to polling
// /polykv/tps?once=1 when the stream stalls. The DOM is built once per tree shape and
// then only text, widths and classes change, keyed by pool id and sequence id, so
// nothing jumps or flickers as values update.
"use strict";
(() => {
  const KEY_STORE = "polykv.apiKey";
  const WINDOW_S = 300; // chart history
  const POOLS_MS = 1000, CAPACITY_MS = 2000, PROPS_MS = 10000;
  // No event for this long: the stream is dead or a proxy buffers it. Generous, because a
  // server busy decoding answers late, and reconnecting would only add to its load.
  const STREAM_STALL_MS = 15000;

  const $ = (id) => document.getElementById(id);
  const el = (tag, cls, text) => {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const setText = (e, t) => { if (e.textContent !== t) e.textContent = t; };
  const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

  const state = {
    key: "",
    props: null,
    pools: null,     // GET /polykv/pools
    slots: new Map(), // seq_id -> /slots entry
    tps: null,       // latest /polykv/tps snapshot
    caps: new Map(), // pool id -> capacity verdict
    hist: { tps: [], kv: [] },
    scale: 0,        // tok/s at the right end of every session bar
    sig: "",         // tree shape the DOM was built for
    mode: "connecting",
    events: 0,       // tps snapshots received (stream or poll)
  };
  try { state.key = localStorage.getItem(KEY_STORE) || ""; } catch (_) { /* storage off */ }

  // ---- HTTP with the key ---------------------------------------------------------
  class AuthError extends Error {}
  class HTTPError extends Error {
    constructor(status, msg) { super(msg); this.status = status; }
  }
  function headers(accept) {
    const h = { Accept: accept || "application/json" };
    if (state.key) h.Authorization = "Bearer " + state.key;
    return h;
  }
  async function getJSON(path) {
    const r = await fetch(path, { headers: headers(), cache: "no-store" });
    if (r.status === 401 || r.status === 403) throw new AuthError(await errorText(r));
    if (!r.ok) throw new HTTPError(r.status, await errorText(r));
    return r.json();
  }
  async function errorText(r) {
    try { const b = await r.json(); return (b.error && b.error.message) || r.statusText; } catch (_) { return r.statusText; }
  }

  // While the server refuses the key every loop waits here, instead of hammering it.
  let authWaiters = [];
  let authNeeded = false;
  function needAuth(msg) {
    if (!authNeeded) {
      authNeeded = true;
      $("keyform").classList.add("needed");
      showBanner(state.key
        ? "The server refused this API key (" + msg + "). Enter the key the server was started with."
        : "This server requires an API key (it runs with --api-key). Enter it above; it is kept in this browser only.");
      setConn("auth", state.key ? "API key refused" : "API key needed");
    }
  }
  function waitAuth() {
    return authNeeded ? new Promise((r) => authWaiters.push(r)) : Promise.resolve();
  }
  function authChanged() {
    authNeeded = false;
    $("keyform").classList.remove("needed");
    showBanner("");
    const w = authWaiters; authWaiters = [];
    w.forEach((r) => r());
    if (streamCtl) streamCtl.abort();
  }
  function showBanner(msg) {
    const b = $("banner");
    b.hidden = !msg;
    setText(b, msg);
  }
  function setConn(mode, text) {
    state.mode = mode;
    $("conn").dataset.state = mode;
    setText($("conn-text"), text);
  }
  // A failure outside auth: the server is down or answered an error.
  function failed(e) {
    if (e instanceof AuthError) { needAuth(e.message); return; }
    if (e instanceof HTTPError) return; // a route error (e.g. a pool released meanwhile)
    setConn("down", "server unreachable");
  }

  // ---- loops ---------------------------------------------------------------------
  async function loop(ms, fn) {
    for (;;) {
      await waitAuth();
      try { await fn(); } catch (e) { failed(e); }
      await sleep(ms);
    }
  }

  async function loadProps() {
    state.props = await getJSON("/props");
    const p = state.props;
    setText($("model"), `${p.model || "?"} · n_ctx ${p.n_ctx} · parallel ${p.parallel} · max pools ${p.polykv ? p.polykv.max_pools : "?"}`);
  }

  async function loadPools() {
    const [pools, slots] = await Promise.all([getJSON("/polykv/pools"), getJSON("/slots")]);
    state.pools = pools;
    state.slots = new Map((slots || []).map((s) => [s.id !== undefined ? s.id : s.seq_id, s]));
    const used = pools.kv_cells_used || 0, max = pools.kv_cells_max || 1;
    let poolCells = 0;
    for (const p of pools.pools) if (pools.kv_bytes_per_cell) poolCells += p.own_kv_bytes / pools.kv_bytes_per_cell;
    push(state.hist.kv, { t: now(), a: 100 * used / max, b: 100 * poolCells / max });
    render();
  }

  async function loadCapacity() {
    if (!state.pools) return;
    const live = state.pools.pools.filter((p) => p.state !== "released");
    const got = await Promise.all(live.map((p) =>
      getJSON(`/polykv/pools/${p.pool_id}/capacity`).then((v) => [p.pool_id, v], (e) => {
        if (e instanceof HTTPError) return [p.pool_id, null];
        throw e;
      })));
    state.caps = new Map(got);
    render();
  }

  // The tps stream: SSE parsed from a fetch() body, so the Authorization header goes along.
  let streamCtl = null;
  async function streamTPS() {
    for (;;) {
      await waitAuth();
      const ctl = new AbortController();
      streamCtl = ctl;
      let watchdog = 0, got = 0;
      const kick = () => { clearTimeout(watchdog); watchdog = setTimeout(() => ctl.abort(), STREAM_STALL_MS); };
      try {
        kick();
        const r = await fetch("/polykv/tps?interval_ms=500", { headers: headers("text/event-stream"), signal: ctl.signal, cache: "no-store" });
        if (r.status === 401 || r.status === 403) throw new AuthError(await errorText(r));
        if (!r.ok || !r.body) throw new HTTPError(r.status, "tps stream: HTTP " + r.status);
        const reader = r.body.getReader();
        const dec = new TextDecoder();
        let buf = "";
        for (;;) {
          const { value, done } = await reader.read();
          if (done) break;
          kick();
          buf += dec.decode(value, { stream: true }).replace(/\r\n/g, "\n");
          let i;
          while ((i = buf.indexOf("\n\n")) >= 0) {
            const block = buf.slice(0, i);
            buf = buf.slice(i + 2);
            const data = block.split("\n").filter((l) => l.startsWith("data:")).map((l) => l.slice(5).trim()).join("\n");
            if (data) { got++; onTPS(JSON.parse(data), "live"); }
          }
        }
        note(`tps stream ended after ${got} events`);
      } catch (e) {
        note(`tps stream: ${e.name === "AbortError" ? "no event for " + STREAM_STALL_MS / 1000 + " s" : e.message} after ${got} events`);
        if (e instanceof AuthError) { needAuth(e.message); continue; }
        if (!(e instanceof HTTPError) && !(e.name === "AbortError")) failed(e);
      } finally {
        clearTimeout(watchdog);
      }
      if (authNeeded) continue;
      // The stream ended, stalled or never started: poll for a while, then retry it.
      const until = Date.now() + (got ? 2000 : 15000);
      while (Date.now() < until && !authNeeded) {
        try { onTPS(await getJSON("/polykv/tps?once=1"), "polling"); } catch (e) { failed(e); }
        await sleep(1000);
      }
    }
  }

  // note keeps the last few stream interruptions, shown as the status tooltip.
  const notes = [];
  function note(msg) {
    notes.push(new Date().toLocaleTimeString() + " " + msg);
    if (notes.length > 5) notes.shift();
    $("conn").title = notes.join("\n");
  }

  function onTPS(snap, mode) {
    state.tps = snap;
    state.events++;
    push(state.hist.tps, { t: now(), a: snap.aggregate_tps || 0, b: snap.n_active ? snap.mean_active_tps || 0 : 0 });
    if (mode === "live") setConn("live", "live · stream 500 ms");
    else setConn("polling", "polling · stream unavailable");
    render();
  }

  // ---- model of what to draw -----------------------------------------------------
  function now() { return Date.now() / 1000; }
  function push(arr, pt) {
    arr.push(pt);
    const cut = pt.t - WINDOW_S;
    while (arr.length && arr[0].t < cut) arr.shift();
  }
  function floorOf(poolId) {
    const c = state.caps.get(poolId);
    if (c && c.target_tps_per_session > 0) return c.target_tps_per_session;
    const f = state.props && state.props.polykv && state.props.polykv.floors;
    return (f && f[String(poolId)]) || 0;
  }
  // Sessions per pool id (null: unpooled), merged from the pools list (membership, own
  // KV), the tps snapshot (speed, context) and /slots (shared tokens), keyed by seq id.
  function sessionsByPool() {
    const by = new Map();
    const rowFor = (pool, seq) => {
      if (!by.has(pool)) by.set(pool, new Map());
      const m = by.get(pool);
      if (!m.has(seq)) m.set(seq, { seq, pool });
      return m.get(seq);
    };
    if (state.pools) {
      for (const p of state.pools.pools) {
        for (const s of p.sessions) Object.assign(rowFor(p.pool_id, s.seq_id), { session: s.session_id, state: s.state, ownKV: s.marginal_kv_bytes });
      }
    }
    const seen = new Set();
    if (state.tps) {
      for (const s of state.tps.sessions) {
        const pool = s.pool_id === null || s.pool_id === undefined ? null : s.pool_id;
        seen.add(s.seq_id);
        // A session the pools list places elsewhere (it moved since): trust the newer tps snapshot.
        for (const [pid, m] of by) if (pid !== pool && m.has(s.seq_id)) m.delete(s.seq_id);
        Object.assign(rowFor(pool, s.seq_id), {
          session: s.session_id, state: s.state, tps: s.tps_ewma, warming: s.warming,
          decoded: s.n_decoded, ctxUsed: s.ctx_used, ctxTotal: s.ctx_total,
        });
      }
    }
    const bpc = state.pools ? state.pools.kv_bytes_per_cell : 0;
    for (const [pid, m] of by) {
      for (const r of m.values()) {
        const sl = state.slots.get(r.seq);
        if (sl) { r.shared = sl.n_shared || 0; if (r.ctxUsed === undefined) r.ctxUsed = sl.n_past; }
        if (pid === null && r.ownKV === undefined && bpc && r.ctxUsed !== undefined) r.ownKV = r.ctxUsed * bpc;
      }
    }
    return by;
  }

  // ---- rendering -----------------------------------------------------------------
  const poolNodes = new Map(); // pool id -> {li, ...parts}
  const rowNodes = new Map();  // "seq:pool" -> row parts

  function render() {
    const by = sessionsByPool();
    const pools = state.pools ? state.pools.pools : [];
    // The shape: pools with their parents and every row's key. Rebuilt (by moving the
    // existing nodes) only when it changes.
    const sig = pools.map((p) => `${p.pool_id}<${p.parent}`).join(",") + "|" +
      [...by].map(([pid, m]) => pid + ":" + [...m.keys()].join(".")).join(";");
    if (sig !== state.sig) { state.sig = sig; build(pools, by); }
    updateScale(by);
    for (const p of pools) updatePool(p, by.get(p.pool_id));
    for (const [pid, m] of by) for (const r of m.values()) updateRow(r, pid === null ? 0 : floorOf(pid));
    updateCards(by);
    drawCharts();
    const f = $("updated");
    setText(f, "updated " + new Date().toLocaleTimeString());
    f.dataset.events = String(state.events);
  }

  function build(pools, by) {
    const byId = new Map(pools.map((p) => [p.pool_id, p]));
    const tree = $("tree");
    const keep = new Set();
    const place = (p, parentUl) => {
      const n = poolNode(p);
      keep.add(p.pool_id);
      parentUl.appendChild(n.li);
      fillRows(n.sessions, by.get(p.pool_id), p.pool_id);
      n.none.hidden = n.sessions.children.length > 0;
      const kids = pools.filter((c) => c.parent === p.pool_id).sort((a, b) => a.pool_id - b.pool_id);
      n.kids.hidden = kids.length === 0;
      for (const c of kids) place(c, n.kids);
    };
    const roots = pools.filter((p) => p.parent === null || !byId.has(p.parent)).sort((a, b) => a.pool_id - b.pool_id);
    for (const r of roots) place(r, tree);
    for (const [id, n] of poolNodes) if (!keep.has(id)) { n.li.remove(); poolNodes.delete(id); }
    // "None" only once the data is in: refused or still loading is not the same as empty.
    $("tree-empty").hidden = !state.pools || pools.length > 0;

    fillRows($("loose"), by.get(null), null);
    $("loose-empty").hidden = !state.tps || $("loose").children.length > 0;
    // Drop rows no longer present anywhere.
    const live = new Set();
    for (const [pid, m] of by) for (const seq of m.keys()) live.add(seq + ":" + pid);
    for (const [k, r] of rowNodes) if (!live.has(k)) { r.row.remove(); rowNodes.delete(k); }
  }

  function fillRows(container, m, pid) {
    const rows = m ? [...m.values()].sort((a, b) => String(a.session || "").localeCompare(String(b.session || "")) || a.seq - b.seq) : [];
    for (const r of rows) container.appendChild(rowNode(r.seq + ":" + pid).row);
  }

  function poolNode(p) {
    let n = poolNodes.get(p.pool_id);
    if (n) return n;
    const li = el("li");
    li.dataset.pool = String(p.pool_id);
    const box = el("div", "pool");
    const head = el("div", "phead");
    const pid = el("span", "pid", "#" + p.pool_id);
    const facts = el("span", "facts");
    const badges = el("span", "badges");
    const edge = el("span", "f edge");
    const len = el("span", "f len");
    const own = el("span", "f own");
    const sub = el("span", "f subtree");
    const nsess = el("span", "f nsess");
    const floor = el("span", "f floor");
    for (const [e, w] of [[badges, 140], [edge, 130], [len, 100], [own, 105], [sub, 125], [nsess, 80], [floor, 125]]) {
      e.style.minWidth = w + "px";
      facts.appendChild(e);
    }
    const verdict = el("span", "verdict");
    verdict.dataset.admit = "unknown";
    const v = el("span", "v", "…");
    const why = el("span", "why", "");
    verdict.append(v, why);
    head.append(pid, facts, verdict);
    const sessions = el("div", "sessions");
    const none = el("div", "none", "no sessions attached");
    box.append(head, sessions, none);
    const kids = el("ul");
    li.append(box, kids);
    n = { li, box, badges, edge, len, own, sub, nsess, floor, verdict, v, why, sessions, none, kids, badgeSig: "" };
    poolNodes.set(p.pool_id, n);
    return n;
  }

  function rowNode(key) {
    let r = rowNodes.get(key);
    if (r) return r;
    const row = el("div", "srow");
    const sid = el("span", "sid");
    const st = el("span", "st");
    const bar = el("span", "bar");
    const fill = el("span", "fill");
    const floor = el("span", "floor");
    bar.append(fill, floor);
    const tps = el("span", "num tps");
    const dec = el("span", "num dec");
    const ctx = el("span", "num ctx");
    const kv = el("span", "num kv");
    row.append(sid, st, bar, tps, dec, ctx, kv);
    r = { row, sid, st, fill, floor, tps, dec, ctx, kv };
    rowNodes.set(key, r);
    return r;
  }

  function updatePool(p, rows) {
    const n = poolNodes.get(p.pool_id);
    if (!n) return;
    const bsig = [p.residency, p.state, p.pinned, p.orphaned_pin].join();
    if (bsig !== n.badgeSig) {
      n.badgeSig = bsig;
      n.badges.replaceChildren();
      const st = p.state === "released" ? "released" : p.residency;
      n.badges.appendChild(el("span", "badge " + st, st));
      if (p.pinned) n.badges.appendChild(el("span", "badge pinned", p.user_pinned ? "pinned" : "auto-pinned"));
      if (p.orphaned_pin) n.badges.appendChild(el("span", "badge orphaned", "orphaned pin"));
      n.box.classList.toggle("released", p.state === "released");
    }
    const parentLen = p.parent === null ? 0 : ((state.pools.pools.find((q) => q.pool_id === p.parent) || {}).prefix_len);
    const edge = p.parent === null ? "root" : (p.branch_pos === parentLen ? `extends #${p.parent}` : `branches #${p.parent} @${p.branch_pos}`);
    setText(n.edge, edge);
    setFact(n.len, "len ", String(p.prefix_len), p.parent === null ? "" : ` (+${p.own_len})`);
    setFact(n.own, "own ", bytes(p.own_kv_bytes), "");
    setFact(n.sub, "subtree ", bytes(p.subtree_kv_bytes), "");
    const ns = rows ? rows.size : 0;
    setFact(n.nsess, "", String(ns), ns === 1 ? " session" : " sessions");
    const fl = floorOf(p.pool_id);
    setFact(n.floor, "floor ", fl ? fmt(fl) : "—", fl ? " tok/s" : "");
    n.li.dataset.floor = String(fl);
    const c = state.caps.get(p.pool_id);
    if (p.state === "released") {
      n.verdict.dataset.admit = "unknown"; setText(n.v, "released"); setText(n.why, "no new attaches");
    } else if (!c) {
      n.verdict.dataset.admit = "unknown"; setText(n.v, "…"); setText(n.why, "capacity pending");
    } else {
      n.verdict.dataset.admit = c.can_admit ? "yes" : "no";
      setText(n.v, c.can_admit ? "admits" : "refuses");
      const room = c.headroom_sessions > 0 ? `room for ${c.headroom_sessions} by KV` : "no KV room";
      setText(n.why, (c.can_admit ? room : c.reason) + (c.mode === "enforced" ? " · enforced" : ""));
      n.verdict.title = `${c.reason} (${c.mode})\nmean ${fmt(c.mean_active_tps)} tok/s → ${fmt(c.projected_mean_tps_if_admitted)} if admitted\nKV headroom ${fmt(c.kv_headroom_pct)} %, ${c.kv_cells_free} cells free`;
    }
  }
  function setFact(e, label, value, unit) {
    if (!e.firstChild) { e.append(label, el("b"), unit); }
    setText(e.childNodes[1], value);
    if (e.childNodes[2].textContent !== unit) e.childNodes[2].textContent = unit;
  }

  function updateScale(by) {
    let hi = 0, floorHi = 0;
    for (const m of by.values()) for (const r of m.values()) if (r.tps) hi = Math.max(hi, r.tps);
    for (const p of state.pools ? state.pools.pools : []) floorHi = Math.max(floorHi, floorOf(p.pool_id));
    // A floor far above every session's speed would squash all bars to nothing: such a
    // floor is drawn at the bar's end (off scale) and widens the scale to at most 3x.
    const top = hi > 0 ? Math.max(hi, Math.min(floorHi, 3 * hi)) : floorHi;
    const want = nice(top * 1.15 || 10);
    // Grow at once, shrink only when far too wide, so bars do not rescale every tick.
    if (want > state.scale || want < state.scale * 0.4) state.scale = want;
  }

  function updateRow(r, floor) {
    const n = rowNodes.get(r.seq + ":" + r.pool);
    if (!n) return;
    setText(n.sid, r.session ? r.session : `seq ${r.seq} (anonymous)`);
    n.sid.title = `${r.session || "(anonymous)"} · seq ${r.seq}`;
    n.row.dataset.session = r.session || "";
    n.row.dataset.seq = String(r.seq);
    n.row.dataset.state = r.state || "idle";
    setText(n.st, r.state || "idle");
    const tps = r.state === "decode" && r.tps !== undefined ? r.tps : null;
    const under = floor > 0 && tps !== null && !r.warming && tps < floor;
    n.row.classList.toggle("under", under);
    n.row.classList.toggle("warming", !!r.warming && r.state === "decode");
    n.fill.style.width = tps === null ? "0" : Math.min(100, 100 * tps / state.scale).toFixed(1) + "%";
    if (floor > 0) {
      const off = floor > state.scale;
      n.floor.style.display = "block";
      n.floor.style.left = `calc(${Math.min(100, 100 * floor / state.scale).toFixed(1)}% - ${off ? 3 : 1}px)`;
      n.floor.classList.toggle("off", off);
      n.floor.title = `floor ${fmt(floor)} tok/s` + (off ? " (beyond the scale)" : "");
    } else n.floor.style.display = "none";
    setText(n.tps, tps === null ? "—" : fmt(tps));
    n.tps.title = r.warming ? "warming: fewer than 4 tokens decoded" : (under ? `under the floor of ${fmt(floor)} tok/s` : "");
    setText(n.dec, r.decoded === undefined ? "—" : String(r.decoded));
    setText(n.ctx, r.ctxUsed === undefined ? "—" : (r.shared ? `${r.ctxUsed} (${r.shared})` : String(r.ctxUsed)));
    setText(n.kv, r.ownKV === undefined ? "—" : bytes(r.ownKV));
  }

  function updateCards(by) {
    const t = state.tps;
    if (t) {
      setText($("agg-tps"), fmt(t.aggregate_tps));
      setText($("prompt-tps"), `prefill ${fmt(t.prompt_tps)} tok/s`);
      setText($("mean-tps"), t.n_active ? fmt(t.mean_active_tps) : "—");
      setText($("sessions-sub"), `${t.n_active} active · ${t.n_warming} warming`);
    }
    let under = 0, withFloor = 0;
    for (const [pid, m] of by) {
      const f = pid === null ? 0 : floorOf(pid);
      if (!f) continue;
      for (const r of m.values()) {
        if (r.state !== "decode" || r.warming || r.tps === undefined) continue;
        withFloor++;
        if (r.tps < f) under++;
      }
    }
    // Until the floors are known (props or a capacity verdict) a 0 would be a guess.
    const known = state.props !== null || state.caps.size > 0;
    setText($("under-n"), known ? String(under) : "—");
    setText($("under-of"), known ? ` of ${withFloor}` : "");
    $("under-n").closest(".card").classList.toggle("alert", under > 0);
    const p = state.pools;
    if (p) {
      const max = p.kv_cells_max || 1;
      let poolCells = 0;
      for (const q of p.pools) if (p.kv_bytes_per_cell) poolCells += q.own_kv_bytes / p.kv_bytes_per_cell;
      setText($("kv-pct"), fmt(100 * p.kv_cells_used / max));
      $("kv-bar-pools").style.width = (100 * poolCells / max).toFixed(2) + "%";
      $("kv-bar-sessions").style.width = (100 * Math.max(0, p.kv_cells_used - poolCells) / max).toFixed(2) + "%";
      setText($("kv-sub"), `${p.kv_cells_used} of ${p.kv_cells_max} cells · ${bytes(p.kv_cells_used * p.kv_bytes_per_cell)} · pools ${Math.round(poolCells)}`);
      const live = p.pools.filter((q) => q.state !== "released").length;
      setText($("pools-n"), String(live));
      setText($("pools-max"), ` / ${p.pools_max}`);
      setText($("seq-sub"), `seq ids ${p.seq_ids_used} / ${p.seq_ids_max} · depth ${p.tree_depth}`);
      setText($("tree-sub"), `${live} pools · depth ${p.tree_depth} · ${bytes(p.kv_bytes_per_cell)} per cell`);
    }
    const loose = by.get(null);
    setText($("loose-sub"), loose && loose.size ? `${loose.size}` : "");
  }

  // ---- charts --------------------------------------------------------------------
  const W = 600, H = 110;
  function drawCharts() {
    const t1 = now();
    const tpsMax = nice(Math.max(1, ...state.hist.tps.map((p) => Math.max(p.a, p.b))));
    setText($("tps-chart-max"), fmt(tpsMax) + " tok/s");
    drawSeries($("tps-chart"), state.hist.tps, t1, tpsMax);
    drawSeries($("kv-chart"), state.hist.kv, t1, 100);
  }
  function drawSeries(svg, pts, t1, ymax) {
    const x = (t) => (W * (t - (t1 - WINDOW_S)) / WINDOW_S).toFixed(1);
    const y = (v) => (H - 2 - (H - 4) * Math.min(1, Math.max(0, v / ymax))).toFixed(1);
    const a = pts.map((p) => `${x(p.t)},${y(p.a)}`);
    const b = pts.map((p) => `${x(p.t)},${y(p.b)}`);
    svg.querySelector(".line").setAttribute("points", a.join(" "));
    svg.querySelector(".line2").setAttribute("points", b.join(" "));
    svg.querySelector(".area").setAttribute("d", pts.length ? `M${x(pts[0].t)},${H} L${a.join(" L")} L${x(pts[pts.length - 1].t)},${H} Z` : "");
    svg.dataset.points = String(pts.length);
  }

  // ---- formatting ----------------------------------------------------------------
  function fmt(v) {
    if (v === null || v === undefined || !isFinite(v)) return "—";
    return v >= 100 ? v.toFixed(0) : v >= 1 || v === 0 ? v.toFixed(1) : v.toFixed(2);
  }
  function bytes(b) {
    if (!b) return "0 B";
    if (b < 1 << 20) return (b / 1024).toFixed(0) + " KiB";
    if (b < 1 << 30) return (b / (1 << 20)).toFixed(1) + " MiB";
    return (b / (1 << 30)).toFixed(2) + " GiB";
  }
  function nice(v) {
    const e = Math.pow(10, Math.floor(Math.log10(v)));
    for (const m of [1, 2, 2.5, 5, 10]) if (m * e >= v) return m * e;
    return 10 * e;
  }

  // ---- key form and start ------------------------------------------------------------
  $("apikey").value = state.key;
  $("keyform").addEventListener("submit", (ev) => {
    ev.preventDefault();
    state.key = $("apikey").value.trim();
    try { if (state.key) localStorage.setItem(KEY_STORE, state.key); else localStorage.removeItem(KEY_STORE); } catch (_) { /* storage off */ }
    authChanged();
  });
  $("key-clear").addEventListener("click", () => {
    state.key = "";
    $("apikey").value = "";
    try { localStorage.removeItem(KEY_STORE); } catch (_) { /* storage off */ }
    authChanged();
  });

  // Exposed for debugging from the browser console.
  window.polykvDashboard = { state, notes };
  loop(PROPS_MS, loadProps);
  loop(POOLS_MS, loadPools);
  loop(CAPACITY_MS, loadCapacity);
  streamTPS();
})();
