// Package app wires a model, a llama context, the engine and the HTTP API together, so
// the CLI, the benchmark and the real-model tests start the same server.
package app

import (
	"fmt"
	"log/slog"
	"path/filepath"
	"runtime"
	"strings"
	"time"

	"github.com/polykv/polykv/internal/api"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/runner"
	"github.com/polykv/polykv/internal/tps"
)

// Config is the server configuration (llama-server-like names in the CLI).
type Config struct {
	ModelPath  string
	NCtx       int // -c
	Parallel   int // --parallel
	NBatch     int // --batch
	NUBatch    int // --ubatch
	Threads    int // -t
	MaxQueue   int // --queue
	SessionTTL time.Duration
	MaxPools   int           // --max-pools: pool sequence ids reserved above the sessions'
	PoolGrace  time.Duration // --pool-grace-ms
	FlashAttn  string        // --flash-attn: on (default), off, auto
	TPSTau     time.Duration // --tps-tau-ms: EWMA time constant of experienced tps
	// ChatTemplate (--chat-template NAME or inline Jinja) and ChatTemplateFile
	// (--chat-template-file PATH) override the GGUF's tokenizer.chat_template.
	ChatTemplate     string
	ChatTemplateFile string
}

// Defaults fills unset fields.
func (c *Config) Defaults() {
	if c.NCtx == 0 {
		c.NCtx = 4096
	}
	if c.Parallel == 0 {
		c.Parallel = 4
	}
	if c.NBatch == 0 {
		c.NBatch = 512
	}
	if c.NUBatch == 0 {
		c.NUBatch = c.NBatch
	}
	if c.Threads == 0 {
		c.Threads = runtime.NumCPU()
	}
	if c.MaxQueue == 0 {
		c.MaxQueue = 64
	}
	if c.SessionTTL == 0 {
		c.SessionTTL = 30 * time.Minute
	}
	if c.MaxPools == 0 {
		c.MaxPools = 16
	}
	if c.MaxPools < 0 { // --max-pools 0 on the command line means none
		c.MaxPools = 0
	}
	if c.PoolGrace == 0 {
		c.PoolGrace = 30 * time.Second
	}
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
}

// Open loads the model and starts the engine.
func Open(cfg Config, log *slog.Logger) (*App, error) {
	cfg.Defaults()
	if cfg.ModelPath == "" {
		return nil, fmt.Errorf("no model: pass -m MODEL.gguf")
	}
	ecfg := engine.Config{NCtx: cfg.NCtx, Parallel: cfg.Parallel, MaxPools: cfg.MaxPools, NBatch: cfg.NBatch,
		MaxQueue: cfg.MaxQueue, SessionTTL: cfg.SessionTTL, PoolGrace: cfg.PoolGrace}
	if err := ecfg.Validate(); err != nil {
		return nil, err
	}
	switch cfg.FlashAttn {
	case "", "off", "on", "auto":
	default:
		return nil, fmt.Errorf("--flash-attn must be off, on or auto, got %q", cfg.FlashAttn)
	}
	model, err := llama.LoadModel(cfg.ModelPath)
	if err != nil {
		return nil, err
	}
	tmplSrc, tmplFrom, err := chat.ResolveTemplate(model.ChatTemplate(), cfg.ChatTemplate, cfg.ChatTemplateFile)
	if err != nil {
		model.Free()
		return nil, err
	}
	renderer := runner.NewChatRenderer(model, tmplSrc)
	if err := renderer.Err(); err != nil && log != nil {
		log.Warn("no usable chat template: chat requests will answer 400; pass --chat-template NAME or --chat-template-file PATH",
			"template", tmplFrom, "reason", err, "builtin_names", strings.Join(chat.BuiltinTemplateNames(), ","))
	}
	ecfg.BytesPerCell = model.KVBytesPerCell()
	if model.IsRecurrent() || model.IsHybrid() {
		// Recurrent state is one blob per sequence, not cells per position: a prefix
		// cannot be shared by sequence membership.
		ecfg.PoolsUnsupported = "this model has recurrent (or hybrid) memory, whose state cannot be shared as a token prefix"
	}
	if cfg.NCtx > model.NCtxTrain() && model.NCtxTrain() > 0 {
		if log != nil {
			log.Warn("context larger than the model was trained for", "n_ctx", cfg.NCtx, "n_ctx_train", model.NCtxTrain())
		}
	}
	fa := FlashAttn(cfg.FlashAttn)
	ctx, err := llama.NewContext(model, llama.ContextParams{FlashAttn: fa,
		NCtx: cfg.NCtx, NBatch: cfg.NBatch, NUBatch: cfg.NUBatch, NSeqMax: cfg.Parallel + cfg.MaxPools,
		NThreads: cfg.Threads, KVUnified: true,
	})
	if err != nil {
		model.Free()
		return nil, err
	}
	metrics := api.NewMetrics()
	ecfg.Observer = metrics
	ecfg.TPSTau = cfg.TPSTau
	sched, err := engine.NewScheduler(ecfg, runner.Vocab{M: model})
	if err != nil {
		ctx.Free()
		model.Free()
		return nil, err
	}
	eng := engine.New(sched, runner.NewBackend(model, ctx, log))
	metrics.SetEngine(eng)
	id := strings.TrimSuffix(filepath.Base(cfg.ModelPath), filepath.Ext(cfg.ModelPath))
	info := api.Info{
		ModelID: id, ModelPath: cfg.ModelPath, ModelDesc: model.Desc(), NCtx: cfg.NCtx, NCtxTrain: model.NCtxTrain(),
		Parallel: cfg.Parallel, NBatch: cfg.NBatch, NVocab: model.NVocab(), ChatTemplate: tmplSrc, Started: time.Now(),
		MaxPools: cfg.MaxPools, PoolGraceMs: cfg.PoolGrace.Milliseconds(), BytesPerCell: ecfg.BytesPerCell, PoolsUnsupported: ecfg.PoolsUnsupported,
	}
	info.TPSTauMs = tps.DefaultTau.Milliseconds()
	if cfg.TPSTau > 0 {
		info.TPSTauMs = cfg.TPSTau.Milliseconds()
	}
	srv := api.New(eng, model, renderer, info, metrics, log)
	return &App{Config: cfg, Model: model, Ctx: ctx, Engine: eng, API: srv}, nil
}

// Close stops the engine, then frees the context and the model.
func (a *App) Close() {
	a.Engine.Close()
	a.Ctx.Free()
	a.Model.Free()
}
