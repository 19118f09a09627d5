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
	"syscall"
	"time"

	"github.com/polykv/polykv/internal/app"
)

func usage() {
	fmt.Fprintln(os.Stderr, `usage:
  polykv serve -m MODEL.gguf [flags]   run the HTTP server
  polykv bench -m MODEL.gguf [flags]   measure server vs raw decode throughput
run "polykv serve -h" for the flags`)
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
		err = bench(os.Args[2:])
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
	fs.IntVar(&cfg.MaxQueue, "queue", cfg.MaxQueue, "requests that may wait for a sequence or an admission gate; more get 503 (0: none wait)")
	fs.DurationVar(&cfg.SessionTTL, "session-ttl", cfg.SessionTTL, "idle sessions older than this lose their KV (0: never)")
	fs.StringVar(&cfg.FlashAttn, "flash-attn", cfg.FlashAttn, "flash attention: on, off or auto. On keeps logits independent of batch shape (pooled == unpooled greedy tokens, bit for bit); off prefills ~1.5x faster at 2k context on CPU but numerics then vary with batch shape")
	fs.DurationVar(&cfg.TPSTau, "tps-tau", cfg.TPSTau, "time constant of the per-session experienced tps EWMA")
	fs.IntVar(&cfg.MaxPools, "max-pools", cfg.MaxPools, "shared-prefix pools: sequence ids reserved above --parallel (0: no pools)")
	fs.Func("pool-grace-ms", fmt.Sprintf("a pool is not reclaimed or evicted within this many ms of its last use (default %d)", cfg.PoolGrace.Milliseconds()), func(v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return fmt.Errorf("want a non-negative integer")
		}
		cfg.PoolGrace = time.Duration(n) * time.Millisecond
		return nil
	})
	gpuFlags(fs, cfg)
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	cfg := app.DefaultConfig()
	coreFlags(fs, &cfg)
	host := fs.String("host", "127.0.0.1", "address to listen on")
	port := fs.Int("port", 8080, "port to listen on (0: any free port)")
	verbose := fs.Bool("v", false, "debug logging")
	_ = fs.Parse(args)
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
		"n_ctx", a.Config.NCtx, "parallel", a.Config.Parallel, "batch", a.Config.NBatch, "threads", a.Config.Threads)
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
