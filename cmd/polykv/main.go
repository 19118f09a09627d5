// Command polykv serves a GGUF model to many cooperating agents from one llama.cpp
// context with a unified KV cache and continuous batching.
//
//	polykv serve -m MODEL.gguf [--host 127.0.0.1] [--port 8080] [-c 4096] [--parallel 4] [-t N] [--batch 512]
//	polykv bench -m MODEL.gguf
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/signal"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/chat"
	"github.com/polykv/polykv/internal/engine"
)

func usage() {
	fmt.Fprintln(os.Stderr, `usage:
  polykv serve -m MODEL.gguf [flags]   run the HTTP server
  polykv bench -m MODEL.gguf [flags]   run the benchmark workloads (--workload; docs/benchmarks.md)
run "polykv serve -h" or "polykv bench -h" for the flags`)
}

func main() {
	if len(os.Args) < 2 {
		usage()
		os.Exit(2)
	}
	var err error
	switch os.Args[1] {
	case "serve":
		err = serve(os.Args[2:])
	case "bench":
		err = runBench(os.Args[2:])
	case "-h", "--help", "help":
		usage()
		return
	default:
		usage()
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "polykv:", err)
		os.Exit(1)
	}
}

// coreFlags registers the flags shared by serve and bench, bound to cfg. Each flag's
// default is cfg's current value (app.DefaultConfig), so defaults are written once and a
// flag that is not given leaves the default, while an explicit 0 means 0.
func coreFlags(fs *flag.FlagSet, cfg *app.Config) {
	fs.StringVar(&cfg.ModelPath, "m", cfg.ModelPath, "GGUF model file")
	fs.StringVar(&cfg.ModelPath, "model", cfg.ModelPath, "GGUF model file (same as -m)")
	fs.IntVar(&cfg.NCtx, "c", cfg.NCtx, "KV cells in the unified cache (context size shared by all sessions)")
	fs.IntVar(&cfg.NCtx, "ctx-size", cfg.NCtx, "same as -c")
	fs.IntVar(&cfg.Parallel, "parallel", cfg.Parallel, "session sequences decoding at once")
	fs.IntVar(&cfg.Parallel, "np", cfg.Parallel, "same as --parallel")
	fs.IntVar(&cfg.Threads, "t", cfg.Threads, "CPU threads (0: one per core)")
	fs.IntVar(&cfg.Threads, "threads", cfg.Threads, "same as -t")
	fs.IntVar(&cfg.NBatch, "batch", cfg.NBatch, "tokens per decode step (decode tokens + prefill chunks)")
	fs.IntVar(&cfg.NBatch, "b", cfg.NBatch, "same as --batch")
	fs.IntVar(&cfg.NUBatch, "ubatch", cfg.NUBatch, "physical micro-batch size (0: the same as --batch)")
	fs.IntVar(&cfg.NPredict, "n-predict", cfg.NPredict, "tokens a request generates at most when it names no max_tokens (0: until the context ends, as llama-server's -1)")
	fs.IntVar(&cfg.MaxQueue, "queue", cfg.MaxQueue, "requests that may wait for a sequence or an admission gate; more get 503 (0: none wait)")
	fs.DurationVar(&cfg.QueueTimeout, "queue-timeout", cfg.QueueTimeout, "a request waiting for a sequence, KV cells or its pool longer than this gets 503 with Retry-After (0: no deadline)")
	fs.IntVar(&cfg.AttachMin, "attach-min-tokens", cfg.AttachMin, "a request naming a pool by pool_key attaches to it (a session of the pool, which pins it) only when it shares at least this many tokens with it; below, it runs unpooled and still borrows the shared cells through the prefix cache")
	fs.DurationVar(&cfg.SessionTTL, "session-ttl", cfg.SessionTTL, "idle sessions older than this lose their KV (0: never); stored /v1/responses responses expire with it")
	fs.IntVar(&cfg.ResponsesMax, "responses-max", cfg.ResponsesMax, "stored /v1/responses responses kept at most, the oldest dropped first (0: 1024)")
	fs.Int64Var(&cfg.ResponsesMaxBytes, "responses-max-bytes", cfg.ResponsesMaxBytes, "bytes of stored /v1/responses responses kept at most, the oldest dropped first (0: 64 MiB)")
	fs.StringVar(&cfg.MMKernel, "mm-kernel", cfg.MMKernel, "CPU matrix kernel for Q4_1, Q4_K and Q6_K weights: polykv (each weight block unpacked once per product, faster prompt batches, logits independent of the batch) or ggml (the linked llama.cpp's own, whose results depend on the batch size); other weight types always use ggml's. The served model's choice, not the process's")
	fs.StringVar(&cfg.FAKernel, "fa-kernel", cfg.FAKernel, "CPU flash-attention kernel: polykv (faster prefill at long context; logits independent of the batch and of where cells sit; visits only a query's own cells; f16, f32, q8_0 and q4_0 caches with K and V of one type) or ggml (the linked llama.cpp's own, also used for every other cache type). The served context's choice, not the process's")
	fs.StringVar(&cfg.KVCompaction, "kv-compaction", cfg.KVCompaction, "auto: compact the KV cache after frees only where attention is not ordered by position (quantized caches, --fa-kernel ggml); always: after every free (the old behaviour, for comparison)")
	fs.StringVar(&cfg.FlashAttn, "flash-attn", cfg.FlashAttn, "flash attention: on, off or auto. On keeps logits independent of batch shape (pooled == unpooled greedy tokens, bit for bit); off is no faster than on with --fa-kernel polykv on CPU, and numerics then vary with batch shape")
	fs.StringVar(&cfg.PrefixCache, "prefix-cache", cfg.PrefixCache, "automatic prefix sharing: on (a request without pool_id starts from the longest prefix any resident sequence holds; finished requests stay cached until their cells are needed) or off (for comparison)")
	fs.StringVar(&cfg.CacheTypeK, "cache-type-k", cfg.CacheTypeK, "K cache type: f16, q8_0, q4_0 (tested), or f32, bf16, q4_1, iq4_nl, q5_0, q5_1")
	fs.StringVar(&cfg.CacheTypeK, "ctk", cfg.CacheTypeK, "same as --cache-type-k")
	fs.StringVar(&cfg.CacheTypeV, "cache-type-v", cfg.CacheTypeV, "V cache type (as --cache-type-k); a quantized V cache needs --flash-attn on")
	fs.StringVar(&cfg.CacheTypeV, "ctv", cfg.CacheTypeV, "same as --cache-type-v")
	fs.StringVar(&cfg.ChatTemplate, "chat-template", cfg.ChatTemplate, "chat template to use instead of the GGUF's: a built-in name ("+strings.Join(chat.BuiltinTemplateNames(), ", ")+") or Jinja source")
	fs.StringVar(&cfg.ChatTemplateFile, "chat-template-file", cfg.ChatTemplateFile, "Jinja chat template file to use instead of the GGUF's")
	fs.DurationVar(&cfg.TPSTau, "tps-tau", cfg.TPSTau, "time constant of the per-session experienced tps EWMA")
	fs.IntVar(&cfg.MaxPools, "max-pools", cfg.MaxPools, "shared-prefix pools: sequence ids reserved above --parallel (0: no pools)")
	fs.Func("pool-grace-ms", fmt.Sprintf("a pool just made or restored is kept for its first use (attach) this many ms while running work can make room for other requests (never against a request nothing running makes room for); a released pool is reclaimed this many ms after its last use (default %d)", cfg.PoolGrace.Milliseconds()), func(v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return fmt.Errorf("want a non-negative integer")
		}
		cfg.PoolGrace = time.Duration(n) * time.Millisecond
		return nil
	})
	fs.IntVar(&cfg.PoolRAMMB, "pool-ram-mb", cfg.PoolRAMMB, "host RAM (MiB) for evicted KV (pools, idle sessions, cached requests), restored instead of prefilled (0: none); a budget, used only as the cache overflows")
	fs.IntVar(&cfg.TierChunk, "tier-chunk", cfg.TierChunk, "tokens per stored segment of an evicted session's or cached request's KV (shared prefixes are stored once per segment)")
	fs.StringVar(&cfg.PoolDir, "pool-dir", cfg.PoolDir, "directory for evicted pools' KV below RAM and for pinned pools that survive restarts (\"\": none)")
	fs.IntVar(&cfg.PoolDiskMB, "pool-disk-mb", cfg.PoolDiskMB, "disk budget (MiB) under --pool-dir")
	fs.StringVar(&cfg.SharedDir, "tier-shared-dir", cfg.SharedDir, "directory of KV chunks shared by the replicas serving this model (another replica's computed prefixes are loaded, not prefilled; \"\": none)")
	fs.StringVar(&cfg.RemoteTier, "tier-remote", cfg.RemoteTier, "Redis URL (redis://host:port/db) of a KV chunk store shared by the replicas on any host, in place of --tier-shared-dir (its size and LRU order are Redis's: maxmemory, allkeys-lru; \"\": none)")
	fs.IntVar(&cfg.SharedMB, "tier-shared-mb", cfg.SharedMB, "budget (MiB) of --tier-shared-dir, kept by every replica, least recently used first out")
	fs.StringVar(&cfg.SlotSavePath, "slot-save-path", cfg.SlotSavePath, "directory for POST /slots/{id}?action=save|restore files (\"\": those actions are off)")
	fs.StringVar(&cfg.SpecType, "spec-type", cfg.SpecType, "speculative decoding: none, or a comma-separated list of drafters tried in order for every decoding session each step: "+strings.Join(engine.SpecTypes, ", ")+" (lossless: greedy and seeded output are the same as without; grammar-constrained requests speculate too, their drafts cut at the first token the grammar forbids)")
	fs.IntVar(&cfg.DraftMax, "draft-max", cfg.DraftMax, "most draft tokens a session proposes per step (speculative decoding)")
	fs.IntVar(&cfg.DraftMin, "draft-min", cfg.DraftMin, "fewest draft tokens worth verifying; a shorter proposal is dropped")
	fs.Float64Var(&cfg.SpecStepCost, "spec-step-cost", cfg.SpecStepCost, "a decode step's fixed cost in batch rows: a draft row is verified only where the tokens it is expected to add pay for it (0: the default, measured on a 2-core CPU; larger where a step is bound by reading weights, e.g. a GPU; negative: no limit)")
	fs.StringVar(&cfg.ModelDraft, "model-draft", cfg.ModelDraft, "draft model (GGUF, the target's vocabulary) for --spec-type draft-simple; alone it turns draft-simple on. With draft-mtp: the MTP assistant of a model whose MTP drafter is a file of its own (Gemma 4's gemma-4-*-assistant); a model with MTP layers needs none")
	fs.IntVar(&cfg.CtxSizeDraft, "ctx-size-draft", cfg.CtxSizeDraft, "KV cells of the draft model's context (0: --ctx-size)")
	fs.Float64Var(&cfg.DraftPMin, "draft-p-min", cfg.DraftPMin, "draft-simple, draft-mtp: stop a session's draft at a token the draft model or MTP head gives less probability than this (-1: 0.75 for a draft model, 0 for MTP)")
	fs.IntVar(&cfg.SpecNgramMin, "spec-ngram-min", cfg.SpecNgramMin, "ngram-simple: the shortest end of the context it looks up (longer: fewer, surer drafts)")
	gpuFlags(fs, cfg)
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	cfg := app.DefaultConfig()
	coreFlags(fs, &cfg)
	loadAPIKeys := apiKeyFlags(fs, &cfg)
	host := fs.String("host", "127.0.0.1", "address to listen on")
	port := fs.Int("port", 8080, "port to listen on (0: any free port)")
	verbose := fs.Bool("v", false, "debug logging")
	fs.StringVar(&cfg.KVEventsEndpoint, "kv-events-endpoint", "", "publish KV events (vLLM format, for llm-d's precise-prefix scorer) on this ZMQ PUB endpoint, e.g. tcp://127.0.0.2:5557 (off when empty)")
	fs.IntVar(&cfg.KVBlockSize, "kv-block-size", cfg.KVBlockSize, "tokens per block in KV events and polykv_cache_config_info (16: vLLM's and llm-d's default)")
	fs.StringVar(&cfg.Alias, "alias", "", "model name to serve (default: the model file's base name); requests routed by llm-d must use it as \"model\"")
	fs.StringVar(&cfg.KVEventsPodID, "kv-events-pod-id", "", "pod id in the KV-event topic kv@<pod-id>@<model> (default: host:port)")
	_ = fs.Parse(args)
	if err := loadAPIKeys(); err != nil {
		return err
	}
	if cfg.KVEventsPodID == "" {
		cfg.KVEventsPodID = net.JoinHostPort(*host, fmt.Sprint(*port))
	}
	level := slog.LevelInfo
	if *verbose {
		level = slog.LevelDebug
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: level}))
	a, err := app.Open(cfg, log)
	if err != nil {
		return err
	}
	defer a.Close()
	ln, err := net.Listen("tcp", net.JoinHostPort(*host, fmt.Sprint(*port)))
	if err != nil {
		return err
	}
	srv := &http.Server{Handler: a.API.Handler(), ReadHeaderTimeout: 10 * time.Second}
	log.Info("polykv listening", "addr", "http://"+ln.Addr().String(), "model", a.Model.Desc(),
		"n_ctx", a.Config.NCtx, "parallel", a.Config.Parallel, "batch", a.Config.NBatch, "threads", a.Config.Threads,
		"api_keys", len(a.Config.APIKeys))
	errc := make(chan error, 1)
	go func() { errc <- srv.Serve(ln) }()
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	select {
	case s := <-sig:
		log.Info("shutting down", "signal", s.String())
	case err := <-errc:
		if !errors.Is(err, http.ErrServerClosed) {
			return err
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	_ = srv.Shutdown(ctx)
	return nil
}
