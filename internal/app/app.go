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
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/llama"
	"github.com/polykv/polykv/internal/runner"
	"github.com/polykv/polykv/internal/tps"
)

// Config is the server configuration (llama-server-like names in the CLI). Every field
// is taken as given: start from DefaultConfig, where each default is written once, and
// change what you need. A zero is a real setting (--session-ttl 0: sessions never
// expire; --max-pools 0: no pools; --queue 0: nothing waits), never "not given".
type Config struct {
	ModelPath  string
	NCtx       int           // -c
	Parallel   int           // --parallel
	NBatch     int           // --batch
	NUBatch    int           // --ubatch; 0: the same as NBatch
	Threads    int           // -t; 0: one per CPU core
	MaxQueue   int           // --queue: requests that may wait; past it, 503
	SessionTTL time.Duration // --session-ttl; 0: idle sessions never expire
	MaxPools   int           // --max-pools: pool sequence ids reserved above the sessions'
	PoolGrace  time.Duration // --pool-grace-ms; 0: no grace
	FlashAttn  string        // --flash-attn: on, off, auto
	TPSTau     time.Duration // --tps-tau: EWMA time constant of experienced tps
	GPULayers  string        // -ngl/--n-gpu-layers: auto, all or N (see ParseGPULayers)
	Device     string        // --device: GPU device names, comma-separated; "": every GPU; none: CPU
	SplitMode  string        // --split-mode: layer, row or none (several GPUs)
}

// DefaultConfig is the configuration `polykv serve` runs with when no flag is given.
func DefaultConfig() Config {
	return Config{
		NCtx:       4096,
		Parallel:   4,
		NBatch:     512,
		MaxQueue:   64,
		SessionTTL: 30 * time.Minute,
		MaxPools:   16,
		PoolGrace:  30 * time.Second,
		FlashAttn:  "on",
		TPSTau:     tps.DefaultTau,
		GPULayers:  "auto",
		SplitMode:  "layer",
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
	switch {
	case c.ModelPath == "":
		return fmt.Errorf("no model: pass -m MODEL.gguf")
	case c.NUBatch < 0 || c.Threads < 0:
		return fmt.Errorf("--ubatch and --threads must not be negative")
	case c.SessionTTL < 0 || c.PoolGrace < 0:
		return fmt.Errorf("--session-ttl and --pool-grace-ms must not be negative")
	case c.TPSTau <= 0:
		return fmt.Errorf("--tps-tau must be positive, got %s", c.TPSTau)
	}
	if _, _, err := ParseGPULayers(c.GPULayers); err != nil {
		return err
	}
	switch c.SplitMode {
	case "layer", "row", "none":
	default:
		return fmt.Errorf("--split-mode must be layer, row or none, got %q", c.SplitMode)
	}
	switch c.FlashAttn {
	case "off", "on", "auto":
	default:
		return fmt.Errorf("--flash-attn must be off, on or auto, got %q", c.FlashAttn)
	}
	return nil
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
	// Offload is where the model runs (CPU, or which GPU devices hold how many layers).
	Offload Offload
}

// Open loads the model and starts the engine.
func Open(cfg Config, log *slog.Logger) (*App, error) {
	cfg = cfg.Resolved()
	if err := cfg.Validate(); err != nil {
		return nil, err
	}
	ecfg := engine.Config{NCtx: cfg.NCtx, Parallel: cfg.Parallel, MaxPools: cfg.MaxPools, NBatch: cfg.NBatch,
		MaxQueue: cfg.MaxQueue, SessionTTL: cfg.SessionTTL, PoolGrace: cfg.PoolGrace, TPSTau: cfg.TPSTau}
	if err := ecfg.Validate(); err != nil {
		return nil, err
	}
	model, off, err := LoadModel(cfg)
	if err != nil {
		return nil, err
	}
	if log != nil {
		if off.GPULayers == 0 {
			log.Info("running on the CPU", "reason", off.CPUReason)
		} else {
			log.Info("GPU offload", "backend", off.Backend, "gpu_layers", off.GPULayers, "layers", off.Layers, "devices", strings.Join(off.GPUDevices, ","))
		}
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
		Parallel: cfg.Parallel, NBatch: cfg.NBatch, NVocab: model.NVocab(), ChatTemplate: model.ChatTemplate(), Started: time.Now(),
		MaxPools: cfg.MaxPools, PoolGraceMs: cfg.PoolGrace.Milliseconds(), BytesPerCell: ecfg.BytesPerCell, PoolsUnsupported: ecfg.PoolsUnsupported,
	}
	info.TPSTauMs = cfg.TPSTau.Milliseconds()
	info.Compute = off
	srv := api.New(eng, model, runner.NewChatRenderer(model), info, metrics, log)
	return &App{Config: cfg, Model: model, Ctx: ctx, Engine: eng, API: srv, Offload: off}, nil
}

// Close stops the engine, then frees the context and the model.
func (a *App) Close() {
	a.Engine.Close()
	a.Ctx.Free()
	a.Model.Free()
}
