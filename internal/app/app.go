// Package app wires a model, a llama context, the engine and the HTTP API together, so
// the CLI, the benchmark and the real-model tests start the same server.
package app

import (
	"context"
	"encoding/json"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/polykv/polykv/internal/admission"
	"github.com/polykv/polykv/internal/api"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/kvevents"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/runner"
	"github.com/polykv/polykv/internal/tier"
	"github.com/polykv/polykv/internal/tps"
)

// Config is the server configuration (llama-server-like names in the CLI). Every field
// is taken as given: start from DefaultConfig, where each default is written once, and
// change what you need. A zero is a real setting (--session-ttl 0: sessions never
// expire; --max-pools 0: no pools; --queue 0: nothing waits), never "not given".
type Config struct {
	ModelPath string
	NCtx      int // -c
	Parallel  int // --parallel
	NBatch    int // --batch
	NUBatch   int // --ubatch; 0: the same as NBatch
	Threads   int // -t; 0: one per CPU core
	MaxQueue  int // --queue: requests that may wait; past it, 503
	// NPredict (--n-predict): the most tokens a request generates when it names no
	// max_tokens (0: until the context ends). Agent CLIs (Codex) send none.
	NPredict int
	// QueueTimeout (--queue-timeout): a request waiting for a sequence, cells or its
	// pool longer than this gets 503 with Retry-After; 0: no deadline.
	QueueTimeout time.Duration
	// AttachMin (--attach-min-tokens): a pool_key request attaches to the pool only when
	// it shares at least this many tokens with it; below, it runs unpooled.
	AttachMin  int
	SessionTTL time.Duration // --session-ttl; 0: idle sessions never expire
	MaxPools   int           // --max-pools: pool sequence ids reserved above the sessions'
	PoolGrace  time.Duration // --pool-grace-ms; 0: no grace
	FlashAttn  string        // --flash-attn: on, off, auto
	FAKernel   string        // --fa-kernel: polykv (default) or ggml: the CPU flash-attention kernel for f16/f32 caches
	// KVCompaction (--kv-compaction): auto (default) compacts the cache after frees only
	// where attention does not sum cells in position order by itself (quantized caches,
	// --fa-kernel ggml); always compacts after every free, as PolyKV did before its kernel
	// ordered cells (kept to measure that cost: bench --workload tenants).
	KVCompaction string
	MMKernel     string        // --mm-kernel: polykv (default) or ggml: the CPU matrix kernel for Q4_1/Q4_K/Q6_K weights
	TPSTau       time.Duration // --tps-tau: EWMA time constant of experienced tps
	CacheTypeK   string        // --cache-type-k: f16, q8_0, q4_0, ...
	CacheTypeV   string        // --cache-type-v: as CacheTypeK; quantized needs flash attention
	// ChatTemplate (--chat-template NAME or inline Jinja) and ChatTemplateFile
	// (--chat-template-file PATH) override the GGUF's tokenizer.chat_template.
	ChatTemplate     string
	ChatTemplateFile string

	// APIKeys (--api-key, --api-key-file): when any is set, every route but /health
	// needs "Authorization: Bearer KEY" with one of them. None: the server is open.
	APIKeys []string

	// KV events for llm-d's precise-prefix scorer (off when KVEventsEndpoint is "").
	KVEventsEndpoint string // --kv-events-endpoint, e.g. tcp://127.0.0.2:5557 (bound)
	KVBlockSize      int    // --kv-block-size
	KVEventsPodID    string // topic pod id (default: the host name)
	// Alias is the model name served (/v1/models, responses, the KV-event topic);
	// default: the model file's base name. A router hashes blocks with the request's
	// model name, so requests must name the model by this.
	Alias string // --alias

	// ResponsesMax and ResponsesMaxBytes bound the stored /v1/responses responses
	// (--responses-max, --responses-max-bytes; 0: the defaults, 1,024 and 64 MiB);
	// they also expire with SessionTTL.
	ResponsesMax      int
	ResponsesMaxBytes int64
	GPULayers         string // -ngl/--n-gpu-layers: auto, all or N (see ParseGPULayers)
	Device            string // --device: GPU device names, comma-separated; "": every GPU; none: CPU
	SplitMode         string // --split-mode: layer, row or none (several GPUs)

	// PrefixCache (--prefix-cache on|off): automatic prefix sharing for requests without
	// a pool_id (issue 12); off only for comparison.
	PrefixCache string

	// The tier below the cache (issues 25, 40): evicted KV (pools' own cells, and
	// segments of TierChunk tokens of idle sessions' and cached sequences' cells) goes to
	// host RAM up to PoolRAMMB (--pool-ram-mb; 0: none), then to disk under PoolDir
	// (--pool-dir; "": none) up to PoolDiskMB (--pool-disk-mb), and is restored from
	// there instead of prefilled. With PoolDir, pinned pools are recorded and come back
	// after a restart.
	PoolRAMMB  int
	PoolDir    string
	PoolDiskMB int
	TierChunk  int // --tier-chunk
	// SharedDir (--tier-shared-dir; "": none) is a directory several replicas serving
	// the same model share (issue 44, tier/shared.go), up to SharedMB (--tier-shared-mb)
	// kept by all of them, least recently used first out: every entry this replica
	// stores goes there too, each request's prompt is saved there when it ends (write
	// through), and a prompt's chunks found there (another replica's) are loaded
	// instead of prefilled. It is a level of its own below PoolDir, never PoolDir: that
	// holds one replica's pool records.
	SharedDir string
	SharedMB  int
	// RemoteTier (--tier-remote; "": none) is a Redis server's URL (redis://host:port/db)
	// that takes SharedDir's place for replicas on different hosts (tier/remote.go): the
	// same write-through and lookup, the store's size and LRU order Redis's own
	// (maxmemory with allkeys-lru). At most one of SharedDir and RemoteTier.
	RemoteTier string
	// SlotSavePath (--slot-save-path): directory of llama-server's slot save/restore
	// files ("": those actions answer 501).
	SlotSavePath string

	// Speculative decoding (issue 23): SpecType (--spec-type) is none or a
	// comma-separated list of drafters (engine.SpecTypes), tried in order; DraftMax
	// (--draft-max) and DraftMin (--draft-min) bound a session's proposal per step;
	// SpecNgramMin (--spec-ngram-min) is the shortest context suffix ngram-simple
	// matches. SpecStepCost (--spec-step-cost) is engine.Spec.StepCost: a step's
	// fixed cost in batch rows for the cost-aware draft limit (0: the default,
	// negative: no limit).
	SpecType           string
	DraftMax, DraftMin int
	SpecNgramMin       int
	SpecStepCost       float64
	// ModelDraft (--model-draft) is a draft model of the target's vocabulary for
	// --spec-type draft-simple (given alone, it turns draft-simple on); CtxSizeDraft
	// (--ctx-size-draft) its context's cells (0: --ctx-size); DraftPMin (--draft-p-min)
	// the probability below which a session's draft stops, for draft-simple and
	// draft-mtp (-1: each one's default; draft.go).
	ModelDraft   string
	CtxSizeDraft int
	DraftPMin    float64

	noSWAAnchors bool // tests only: show what goes wrong without runner SWA anchors
}

// DefaultConfig is the configuration `polykv serve` runs with when no flag is given.
func DefaultConfig() Config {
	return Config{
		NCtx:     4096,
		Parallel: 4,
		NBatch:   512,
		MaxQueue: 64,
		// The design's queue_timeout_ms (an enforced pool's admission queue): one bound on
		// how long any request is held before it is told to come back.
		QueueTimeout: 30 * time.Second,
		// Four KV blocks of 16: well past a chat template's opening (SmolLM2's is 12
		// tokens), far below any system prompt worth a pool.
		AttachMin:    64,
		SessionTTL:   30 * time.Minute,
		MaxPools:     16,
		PoolGrace:    30 * time.Second,
		FlashAttn:    "on",
		FAKernel:     "polykv",
		KVCompaction: "auto",
		MMKernel:     "polykv",
		PrefixCache:  "on",
		PoolRAMMB:    8192, // llama-server's --cache-ram default: a budget, not an allocation
		TierChunk:    engine.DefaultTierChunk,
		PoolDiskMB:   4096,
		SharedMB:     16384,
		TPSTau:       tps.DefaultTau,
		CacheTypeK:   "f16",
		CacheTypeV:   "f16",
		KVBlockSize:  kvevents.DefaultBlockSize,
		GPULayers:    "auto",
		SplitMode:    "layer",
		SpecType:     engine.SpecNone,
		DraftMax:     engine.DefaultDraftMax,
		SpecNgramMin: engine.DefaultNgramMin,
		DraftPMin:    -1, // the drafter's default: engine.DefaultDraftPMin, engine.DefaultMTPPMin
	}
}

// Resolved fills the settings that derive from others (ubatch from batch, threads from
// the machine), so what the server reports is what it runs with.
func (c Config) Resolved() Config {
	if c.NUBatch == 0 {
		c.NUBatch = c.NBatch
	}
	if c.Threads == 0 {
		c.Threads = runtime.NumCPU()
	}
	return c
}

// Validate checks the settings that the engine does not check itself.
func (c Config) Validate() error {
	_, err := c.validate()
	return err
}

// validate is Validate, which reads --spec-type and the draft flags (specPlan): what
// they say is returned, so that Open reads them once.
func (c Config) validate() (specPlan, error) {
	switch {
	case c.ModelPath == "":
		return specPlan{}, fmt.Errorf("no model: pass -m MODEL.gguf")
	case c.NUBatch < 0 || c.Threads < 0:
		return specPlan{}, fmt.Errorf("--ubatch and --threads must not be negative")
	case c.SessionTTL < 0 || c.PoolGrace < 0:
		return specPlan{}, fmt.Errorf("--session-ttl and --pool-grace-ms must not be negative")
	case c.QueueTimeout < 0:
		return specPlan{}, fmt.Errorf("--queue-timeout must not be negative, got %s", c.QueueTimeout)
	case c.NPredict < 0:
		return specPlan{}, fmt.Errorf("--n-predict must not be negative, got %d", c.NPredict)
	case c.AttachMin < 0:
		return specPlan{}, fmt.Errorf("--attach-min-tokens must not be negative, got %d", c.AttachMin)
	case c.ResponsesMax < 0 || c.ResponsesMaxBytes < 0:
		return specPlan{}, fmt.Errorf("--responses-max and --responses-max-bytes must not be negative")
	case c.TPSTau <= 0:
		return specPlan{}, fmt.Errorf("--tps-tau must be positive, got %s", c.TPSTau)
	case c.KVBlockSize < 1:
		return specPlan{}, fmt.Errorf("--kv-block-size must be positive, got %d", c.KVBlockSize)
	case c.PoolRAMMB < 0 || c.PoolDiskMB < 0 || c.SharedMB < 0:
		return specPlan{}, fmt.Errorf("--pool-ram-mb, --pool-disk-mb and --tier-shared-mb must not be negative")
	case c.SharedDir != "" && c.RemoteTier != "":
		return specPlan{}, fmt.Errorf("--tier-shared-dir and --tier-remote cannot both be set: the fleet has one level")
	case c.SharedDir != "" && c.SharedDir == c.PoolDir:
		return specPlan{}, fmt.Errorf("--tier-shared-dir must not be --pool-dir: that directory holds this replica's own pool records")
	case c.TierChunk < 16 || c.TierChunk > 1<<16:
		return specPlan{}, fmt.Errorf("--tier-chunk must be between 16 and 65536 tokens, got %d", c.TierChunk)
	}
	if _, _, err := ParseGPULayers(c.GPULayers); err != nil {
		return specPlan{}, err
	}
	switch c.SplitMode {
	case "layer", "row", "none":
	default:
		return specPlan{}, fmt.Errorf("--split-mode must be layer, row or none, got %q", c.SplitMode)
	}
	switch c.FlashAttn {
	case "off", "on", "auto":
	default:
		return specPlan{}, fmt.Errorf("--flash-attn must be off, on or auto, got %q", c.FlashAttn)
	}
	switch c.KVCompaction {
	case "auto", "always":
	default:
		return specPlan{}, fmt.Errorf("--kv-compaction must be auto or always, got %q", c.KVCompaction)
	}
	switch c.FAKernel {
	case "", "polykv", "ggml":
	default:
		return specPlan{}, fmt.Errorf("--fa-kernel must be polykv or ggml, got %q", c.FAKernel)
	}
	switch c.MMKernel {
	case "", "polykv", "ggml":
	default:
		return specPlan{}, fmt.Errorf("--mm-kernel must be polykv or ggml, got %q", c.MMKernel)
	}
	switch c.PrefixCache {
	case "off", "on":
	default:
		return specPlan{}, fmt.Errorf("--prefix-cache must be on or off, got %q", c.PrefixCache)
	}
	plan, err := c.specPlan()
	if err != nil {
		return specPlan{}, err
	}
	if c.DraftMax < 1 || c.DraftMax > engine.MaxDraft || c.DraftMin < 0 || c.DraftMin > c.DraftMax {
		return specPlan{}, fmt.Errorf("--draft-max must be in 1..%d and --draft-min in 0..--draft-max, got %d and %d", engine.MaxDraft, c.DraftMax, c.DraftMin)
	}
	if c.SpecNgramMin < 1 || c.SpecNgramMin > engine.DefaultNgramMax {
		return specPlan{}, fmt.Errorf("--spec-ngram-min must be in 1..%d, got %d", engine.DefaultNgramMax, c.SpecNgramMin)
	}
	return plan, nil
}

// FlashAttn maps a --flash-attn value to llama.cpp's setting. On is the default: with
// flash attention a token's logits on this backend do not depend on the batch it is
// computed in, which is what makes a pooled session's greedy tokens equal a full
// prefill's (off is faster on CPU at long context, but batch shape then moves logits).
func FlashAttn(v string) int {
	switch v {
	case "off":
		return 0
	case "auto":
		return -1
	}
	return 1
}

// App is a running server core.
type App struct {
	Config Config
	Model  *llama.Model
	Ctx    *llama.Context
	Engine *engine.Engine
	API    *api.Server
	// KVEvents publishes pool prefixes over ZMQ (nil when off).
	KVEvents *kvevents.Publisher
	// Offload is where the model runs (CPU, or which GPU devices hold how many layers).
	Offload Offload
	// Tier is the store below the cache (nil when off or refused: TierOff says why).
	Tier    *tier.Store
	TierOff string

	backend *runner.Backend
	draft   *draftModel // the drafter with a model of its own (nil: none)
	// cleanups releases what Open acquired, last first (Close).
	cleanups cleanups
}

// Compactions is the number of whole-KV-cache compactions so far and the time they took
// (see runner.Backend.Compactions).
func (a *App) Compactions() (int64, time.Duration) { return a.backend.Compactions() }

// cleanups is a stack of releases: Open pushes one for everything it acquires (the
// model, contexts, the drafter's, the KV-event publisher, the tier store, the engine)
// and runs the stack, last first, when a later step fails; Close runs it too.
type cleanups []func()

func (c *cleanups) push(f func()) { *c = append(*c, f) }

// run releases everything, last acquired first, and empties the stack.
func (c *cleanups) run() {
	for i := len(*c) - 1; i >= 0; i-- {
		(*c)[i]()
	}
	*c = nil
}

// opening is what Open has built so far: each of its steps reads what the steps before
// it made, adds its own, and pushes what it acquires on cleanups.
type opening struct {
	cfg      Config
	log      *slog.Logger
	spec     specPlan
	ecfg     engine.Config
	tk, tv   llama.CacheType
	model    *llama.Model
	off      Offload
	tmplSrc  string
	renderer *chat.Renderer
	pol      runner.Policy
	nSeq     int
	cp       llama.ContextParams
	ctx      *llama.Context
	metrics  *api.Metrics
	id       string
	pub      *kvevents.Publisher
	store    *tier.Store
	tierOff  string
	key      string
	backend  *runner.Backend
	draft    *draftModel
	eng      *engine.Engine
	srv      *api.Server
	cleanups cleanups
}

// Open loads the model and starts the engine: the steps below, in order; a step that
// fails releases what the earlier ones acquired.
func Open(cfg Config, log *slog.Logger) (*App, error) {
	o := &opening{cfg: cfg.Resolved(), log: log}
	for _, step := range []func() error{
		o.settings,  // flags, the engine's configuration, cache types
		o.loadModel, // the model, placed on the devices; the drafter's model checks
		o.template,  // the chat template
		o.context,   // the architecture's policy, the llama.cpp context, recurrent rollback
		o.kvEvents,  // metrics, the model's name, the KV-event publisher
		o.tier,      // the store below the cache
		o.drafter,   // the backend and the drafter with a model of its own
		o.engine,    // the scheduler and the engine; recorded pools recovered
		o.api,       // the HTTP API
	} {
		if err := step(); err != nil {
			o.cleanups.run()
			return nil, err
		}
	}
	return &App{Config: o.cfg, Model: o.model, Ctx: o.ctx, Engine: o.eng, API: o.srv, KVEvents: o.pub, Offload: o.off,
		Tier: o.store, TierOff: o.tierOff, backend: o.backend, draft: o.draft, cleanups: o.cleanups}, nil
}

// settings validates the flags (reading --spec-type once) and makes the engine's
// configuration.
func (o *opening) settings() error {
	cfg := o.cfg
	var err error
	if o.spec, err = cfg.validate(); err != nil {
		return err
	}
	o.ecfg = engine.Config{NCtx: cfg.NCtx, Parallel: cfg.Parallel, MaxPools: cfg.MaxPools, NBatch: cfg.NBatch,
		MaxQueue: cfg.MaxQueue, QueueTimeout: cfg.QueueTimeout, AttachMin: cfg.AttachMin, SessionTTL: cfg.SessionTTL, PoolGrace: cfg.PoolGrace, TPSTau: cfg.TPSTau,
		PrefixCache: cfg.PrefixCache == "on", TierChunk: cfg.TierChunk}
	o.ecfg.Spec = engine.Spec{Types: o.spec.types, DraftMax: cfg.DraftMax, DraftMin: cfg.DraftMin, NgramMin: cfg.SpecNgramMin, StepCost: cfg.SpecStepCost}
	if err := o.ecfg.Validate(); err != nil {
		return err
	}
	o.tk, o.tv = llama.CacheType(cfg.CacheTypeK), llama.CacheType(cfg.CacheTypeV)
	for _, c := range []struct {
		flag string
		t    llama.CacheType
	}{{"--cache-type-k", o.tk}, {"--cache-type-v", o.tv}} {
		if !c.t.Valid() {
			return fmt.Errorf("%s %q: want one of %s", c.flag, string(c.t), llama.CacheTypeNames)
		}
	}
	if o.tv.Quantized() && cfg.FlashAttn == "off" {
		return fmt.Errorf("--cache-type-v %s needs --flash-attn on (llama.cpp cannot use a quantized V cache without it)", o.tv)
	}
	return nil
}

// loadModel loads the model where -ngl and --device place it and checks that the drafter
// can draft for it.
func (o *opening) loadModel() error {
	model, off, err := loadModel(o.cfg, o.spec.mtpLayers())
	if err != nil {
		return err
	}
	o.model, o.off = model, off
	o.cleanups.push(model.Free)
	if op := o.spec.open; op != nil && op.checkModel != nil {
		if err := op.checkModel(o.cfg, model); err != nil {
			return err
		}
	}
	if o.log != nil {
		if off.GPULayers == 0 {
			o.log.Info("running on the CPU", "reason", off.CPUReason)
		} else {
			o.log.Info("GPU offload", "backend", off.Backend, "gpu_layers", off.GPULayers, "layers", off.Layers, "devices", strings.Join(off.GPUDevices, ","))
		}
	}
	return nil
}

// template resolves the chat template (the model's or the flags' override).
func (o *opening) template() error {
	cfg := o.cfg
	tmplSrc, tmplFrom, err := chat.ResolveTemplate(o.model.ChatTemplate(), cfg.ChatTemplate, cfg.ChatTemplateFile)
	if err != nil {
		return err
	}
	o.tmplSrc = tmplSrc
	o.renderer = runner.NewChatRenderer(o.model, tmplSrc)
	if err := o.renderer.Err(); err != nil && o.log != nil {
		o.log.Warn("no usable chat template: chat requests will answer 400; pass --chat-template NAME or --chat-template-file PATH",
			"template", tmplFrom, "reason", err, "builtin_names", strings.Join(chat.BuiltinTemplateNames(), ","))
	}
	return nil
}

// context applies what the architecture allows (runner.Policy) and opens the llama.cpp
// context.
func (o *opening) context() error {
	cfg, model, log := o.cfg, o.model, o.log
	// Bytes per cell from the real element types: pool and session KV accounting
	// (own_kv_bytes, marginal_kv_bytes, ...) scale with them.
	o.ecfg.BytesPerCell = model.KVBytesPerCellTyped(o.tk, o.tv)
	// What the architecture allows (recurrent state, sliding windows): runner.Policy.
	pol := runner.ModelPolicy(model)
	pol.Anchors = pol.Anchors && !cfg.noSWAAnchors
	specAsked := o.ecfg.Spec.On()
	if pol.Configure(&o.ecfg) && log != nil {
		log.Info("prefix cache off: recurrent memory cannot be shared at an arbitrary token prefix")
	}
	if cfg.NCtx > model.NCtxTrain() && model.NCtxTrain() > 0 {
		if log != nil {
			log.Warn("context larger than the model was trained for", "n_ctx", cfg.NCtx, "n_ctx_train", model.NCtxTrain())
		}
	}
	fa := FlashAttn(cfg.FlashAttn)
	nSeq := cfg.Parallel + cfg.MaxPools
	if err := pol.Check(nSeq, cfg.NBatch, cfg.NUBatch); err != nil {
		return err
	}
	cp := llama.ContextParams{FlashAttn: fa,
		NCtx: cfg.NCtx, NBatch: cfg.NBatch, NUBatch: cfg.NUBatch, NSeqMax: pol.ContextSeqs(nSeq),
		NThreads: cfg.Threads, KVUnified: true, TypeK: o.tk, TypeV: o.tv, AttnKernel: llama.KernelNamed(cfg.FAKernel),
	}
	pol.Params(&cp)
	if o.spec.assistant(cfg) {
		// An MTP assistant's draft decode places one entry per drafting session in the
		// target's cache (it writes nothing there, but llama.cpp wants free cells for
		// them): the context has that many cells beyond the scheduler's, which it never
		// fills, so a full cache does not stop the drafts.
		cp.NCtx += cfg.Parallel
	}
	if specAsked {
		// A recurrent state is cut back past a rejected draft through llama.cpp's
		// per-sequence snapshots (n_rs_seq): one more copy of the state per draft
		// position, for every sequence (RecurrentBytesPerSeq counts them).
		cp.RSSeq = pol.SpecRollback(o.ecfg.Spec.DraftMax, cfg.NUBatch)
	}
	ctx, err := llama.NewContext(model, cp)
	if err != nil {
		return err
	}
	o.cleanups.push(ctx.Free)
	o.pol, o.nSeq, o.cp, o.ctx = pol, nSeq, cp, ctx
	if specAsked && pol.Recurrent {
		// Read back: llama.cpp clamps n_rs_seq to 0 on architectures without rollback.
		if r := ctx.RSSeq(); r > 0 {
			o.ecfg.Rollback = r
			o.ecfg.Spec.DraftMax = min(o.ecfg.Spec.DraftMax, r)
			o.ecfg.Spec.DraftMin = min(o.ecfg.Spec.DraftMin, r)
			if log != nil {
				log.Info("speculative decoding on a recurrent model: rejected drafts are rolled back through state snapshots",
					"draft_max", o.ecfg.Spec.DraftMax, "n_rs_seq", r, "recurrent_bytes_per_seq", ctx.RecurrentBytesPerSeq())
			}
		} else {
			o.ecfg.Spec = engine.Spec{}
			if log != nil {
				log.Info("speculative decoding off: this model's recurrent state cannot be cut back past a rejected draft here (llama.cpp has no rollback for this architecture)")
			}
		}
	}
	// A hybrid's or recurrent model's per-sequence state, from the context's memory: pool
	// and session reports count it beside their KV bytes.
	o.ecfg.RecurrentBytesPerSeq = ctx.RecurrentBytesPerSeq()
	return nil
}

// kvEvents makes the metrics and the model's name, and opens the KV-event publisher
// when --kv-events-endpoint asks for one.
func (o *opening) kvEvents() error {
	cfg := o.cfg
	o.metrics = api.NewMetrics()
	o.metrics.SetCacheConfig(cfg.KVBlockSize, cfg.NCtx)
	o.id = strings.TrimSuffix(filepath.Base(cfg.ModelPath), filepath.Ext(cfg.ModelPath))
	if cfg.Alias != "" {
		o.id = cfg.Alias
	}
	if cfg.KVEventsEndpoint == "" {
		return nil
	}
	podID := cfg.KVEventsPodID
	if podID == "" {
		podID, _ = os.Hostname()
	}
	pub, err := kvevents.Open(kvevents.Config{Endpoint: cfg.KVEventsEndpoint, BlockSize: cfg.KVBlockSize,
		PodID: podID, Model: o.id, Log: o.log})
	if err != nil {
		return err
	}
	o.pub = pub
	o.cleanups.push(func() { _ = pub.Close() })
	o.metrics.AddKVEvents(func() float64 { return float64(pub.Sent.Load()) },
		func() float64 { return float64(pub.Snapshots.Load()) },
		func() float64 { return float64(pub.Dropped.Load()) })
	return nil
}

// tier opens the store below the cache (openTier).
func (o *opening) tier() error {
	store, tierOff, key, err := openTier(o.cfg, o.model, o.ecfg, o.pol, o.log)
	if err != nil {
		return err
	}
	o.store, o.tierOff, o.key = store, tierOff, key
	if store != nil {
		o.cleanups.push(store.Close)
		o.ecfg.Tier, o.ecfg.TierRecord, o.ecfg.PoolIDFloor = true, store.Durable(), store.IDFloor()
		o.ecfg.TierWriteThrough = o.cfg.fleetLevel()
		o.ecfg.TierFleet = o.cfg.fleetLevel()
	}
	return nil
}

// drafter makes the backend and opens the drafter with a model of its own, if the
// server runs one (its registry entry's opener: specPlan).
func (o *opening) drafter() error {
	o.backend = runner.NewBackend(o.model, o.ctx, o.log)
	op := o.spec.open
	if !o.ecfg.Spec.On() || op == nil {
		return nil
	}
	d, err := op.open(o, o.cfg.DraftPMinFor(o.spec.model.Name))
	if err != nil {
		return err
	}
	o.draft = d
	o.backend.EnableDrafter(d.drafter)
	// A drafter that follows the target (an MTP head) keeps a cell and a row beside
	// every cell the target holds: the pools' and sessions' KV bytes count them (the
	// scheduler reads BytesPerCell; 0 for a draft model or an MTP assistant).
	o.ecfg.BytesPerCell += d.bytesPerCell
	// A follower with cells of its own (an MTP head) needs its part of every cell a
	// sequence's segments would carry, which they do not: such a server spills no session
	// or cached sequence (pools spill with their part, as before).
	o.ecfg.NoSequenceSpill = o.backend.FollowerHasPart()
	return nil
}

// engine starts the scheduler and the engine over the backend, and recovers the pools
// an earlier run recorded.
func (o *opening) engine() error {
	cfg, backend, log := o.cfg, o.backend, o.log
	if o.store != nil && o.ecfg.BytesPerCell > 0 {
		// The scheduler's index of stored segments need not outlive what the tier can
		// hold: twice its budgets in tokens.
		budget := int64(cfg.PoolRAMMB) << 20
		if cfg.PoolDir != "" {
			budget += int64(cfg.PoolDiskMB) << 20
		}
		if cfg.fleetLevel() {
			budget += int64(cfg.SharedMB) << 20 // a remote store's own size is unknown: the same bound
		}
		o.ecfg.TierIndexTokens = int(min(2*budget/o.ecfg.BytesPerCell, 1<<28))
	}
	sched, err := engine.NewScheduler(o.ecfg, runner.Vocab{M: o.model})
	if err != nil {
		return err
	}
	var obs engine.Observer = o.metrics
	if o.pub != nil {
		sched.ReportResidency()
		obs = observers{o.metrics, o.pub} // the engine hands it every sequence's changes too
	}
	backend.AlwaysCompact(cfg.KVCompaction == "always")
	if !o.ctx.OrderedAttention() && log != nil {
		log.Info("attention is not ordered by position here: the KV cache is compacted after frees", "cache_type_k", cfg.CacheTypeK, "fa_kernel", cfg.FAKernel, "flash_attn", cfg.FlashAttn)
	}
	o.pol.Enable(backend, o.nSeq)
	if o.store != nil {
		backend.EnableTier(o.store)
		o.metrics.SetTier(o.store)
	}
	o.metrics.AddCompactions(backend.Compactions)
	o.eng = engine.New(sched, backend, obs)
	o.cleanups.push(o.eng.Close) // first at Close: the engine goroutine uses everything above
	if o.store != nil {
		// The tier reports what lands in and leaves its own levels: the scheduler's index
		// of what lives below the cells follows it, and the KV-event publisher announces
		// it with the tier's medium.
		if o.pub != nil {
			o.store.SetObserver(tierObservers{o.eng, o.pub}) // the publisher announces what --pool-dir holds at startup too
		} else {
			o.store.SetChangeObserver(o.eng)
		}
	}
	if o.store != nil && cfg.fleetLevel() && !o.ecfg.NoSequenceSpill {
		// The scheduler's index knows what this replica stored; what other replicas
		// stored in the shared directory is looked up per request, off the engine
		// goroutine.
		store, chunk := o.store, o.ecfg.TierChunk
		o.eng.SetTierLookup(func(prompt []engine.Token) []engine.Segment {
			var segs []engine.Segment
			for _, m := range store.Run(prompt, chunk) {
				segs = append(segs, engine.Segment{Start: m.D, Tokens: m.Tokens})
			}
			return segs
		})
	}
	o.metrics.SetEngine(o.eng)
	recoverPools(o.eng, o.store, log)
	return nil
}

// api makes the HTTP API.
func (o *opening) api() error {
	cfg, model := o.cfg, o.model
	info := api.Info{
		ModelID: o.id, ModelPath: cfg.ModelPath, ModelDesc: model.Desc(), NCtx: cfg.NCtx, NCtxTrain: model.NCtxTrain(),
		Parallel: cfg.Parallel, NBatch: cfg.NBatch, NVocab: model.NVocab(), ChatTemplate: o.tmplSrc, Started: time.Now(),
		MaxPools: cfg.MaxPools, PoolGraceMs: cfg.PoolGrace.Milliseconds(), BytesPerCell: o.ecfg.BytesPerCell,
	}
	info.TPSTauMs = cfg.TPSTau.Milliseconds()
	info.NPredict = cfg.NPredict
	info.PrefixCache = o.ecfg.PrefixCache
	info.Spec = o.ecfg.Spec
	info.Compute = o.off
	info.SessionTTL, info.ResponsesMax, info.ResponsesMaxBytes = cfg.SessionTTL, cfg.ResponsesMax, cfg.ResponsesMaxBytes
	info.BuildInfo, info.CPUFeatures = llama.BuildInfo(), llama.CPUFeatures()
	info.OrderedAttention = o.ctx.OrderedAttention
	info.PoolTier = o.tierOff
	info.SlotSavePath, info.ModelKey = cfg.SlotSavePath, o.key
	o.srv = api.New(o.eng, model, o.renderer, info, o.metrics, o.log)
	if o.store != nil {
		o.srv.SetTier(o.store)
	}
	o.srv.RequireAPIKeys(cfg.APIKeys)
	return nil
}

// tierObservers hands the tier's reports to each of its observers in turn.
type tierObservers []tier.Observer

// TierChanged implements tier.Observer.
func (ts tierObservers) TierChanged(d int, tokens []int32, stored bool) {
	for _, o := range ts {
		o.TierChanged(d, tokens, stored)
	}
}

// observers is the metrics and the KV-event publisher as one engine Observer: the
// metrics take the measurements, the publisher the sequences' changes (residency).
type observers struct {
	*api.Metrics
	*kvevents.Publisher
}

// Close stops the engine, then releases what Open acquired, last first: the KV-event
// publisher and the tier store after the engine (it reports no change once closed;
// queued disk writes finish), the drafter's contexts and model before the served
// context they read, the model last.
func (a *App) Close() { a.cleanups.run() }

// openTier opens the store below the cache when --pool-ram-mb or --pool-dir asks for
// one, or says why the tier is off for this model (the second result; "" when on or
// not asked for). The third is the model key saved KV is valid for, when the tier or
// --slot-save-path needs it. Refused without pools and for the models whose policy
// refuses it (runner.Policy.TierOff: sliding-window and recurrent models); their
// evicted pools are prefilled again, as without a tier.
func openTier(cfg Config, model *llama.Model, ecfg engine.Config, pol runner.Policy, log *slog.Logger) (*tier.Store, string, string, error) {
	key := ""
	if cfg.SlotSavePath != "" || cfg.PoolRAMMB > 0 || cfg.PoolDir != "" || cfg.fleetLevel() {
		var err error
		if key, err = modelKey(cfg, model); err != nil {
			return nil, "", "", err
		}
	}
	if cfg.PoolRAMMB == 0 && cfg.PoolDir == "" && !cfg.fleetLevel() {
		return nil, "", key, nil
	}
	off := pol.TierOff()
	if off != "" {
		if log != nil {
			log.Info("pool tier off", "reason", off)
		}
		return nil, off, key, nil
	}
	store, err := tier.Open(tier.Config{Model: key, RAMBytes: int64(cfg.PoolRAMMB) << 20, Dir: cfg.PoolDir,
		DiskBytes: int64(cfg.PoolDiskMB) << 20, SharedDir: cfg.SharedDir, SharedBytes: int64(cfg.SharedMB) << 20, Remote: cfg.RemoteTier, Log: log})
	return store, "", key, err
}

// fleetLevel reports whether a level shared by replicas is configured (a shared
// directory or a remote store).
func (c Config) fleetLevel() bool { return c.SharedDir != "" || c.RemoteTier != "" }

// recoverPools puts back the pools an earlier run recorded under --pool-dir, parents
// first, under their ids, with their pin and admission policy; a pinned one is
// restored at once: from disk when its KV entry verified, else by a prefill (from its
// parent's cells for a child). A pool whose parent is not back (the parent's record
// was lost, or it was never pinned) comes back as a root: its id, tokens and
// prefix_hash are kept, its KV is prefilled in full. A pool the engine refuses is
// reported lost (tier.Store.Lost), as the store reports damaged records.
func recoverPools(eng *engine.Engine, store *tier.Store, log *slog.Logger) {
	if store == nil {
		return
	}
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	back := map[int]bool{}
	for _, r := range store.Recovered() {
		m := engine.RecoverPool{ID: r.ID, Parent: r.Parent, D: r.D, Tokens: r.Tokens, Pin: r.Pin, InTier: r.InTier}
		if m.Parent != 0 && !back[m.Parent] {
			log.Warn("recorded pool's parent is not back; the pool comes back as a root and is prefilled", "pool", r.ID, "parent", r.Parent, "branch_pos", r.D)
			m.Parent, m.D, m.InTier = 0, 0, false
		}
		res, err := eng.Send(context.Background(), m)
		if err == nil {
			err = res.Err
		}
		if err != nil {
			store.MarkLost(r.ID, tier.LostRefused, err)
			continue
		}
		back[r.ID] = true
		if r.Admission != nil {
			var pol admission.Policy
			err := json.Unmarshal(r.Admission, &pol)
			if err == nil {
				res, err = eng.Send(context.Background(), engine.SetAdmission{Pool: r.ID, Patch: admission.Replace(pol)})
				if err == nil {
					err = res.Err
				}
			}
			if err != nil {
				log.Warn("recorded pool's admission policy not restored; it has the default", "pool", r.ID, "err", err)
			}
		}
		if info, err := eng.Snapshot().Pool(r.ID); err == nil && r.PrefixHash != "" && info.PrefixHash != r.PrefixHash {
			log.Warn("recovered pool's prefix_hash differs from the one recorded", "pool", r.ID, "recorded", r.PrefixHash, "now", info.PrefixHash)
		}
	}
}

// modelKey is what saved KV is valid for (tier.ModelKey), from the GGUF's sha256.
func modelKey(cfg Config, model *llama.Model) (string, error) {
	sum, err := tier.FileSHA256(cfg.ModelPath)
	if err != nil {
		return "", fmt.Errorf("hashing the model for saved KV: %w", err)
	}
	return tier.ModelKey(sum, llama.BuildInfo(), cfg.CacheTypeK, cfg.CacheTypeV, cfg.FlashAttn, model.NSWA() > 0), nil
}
