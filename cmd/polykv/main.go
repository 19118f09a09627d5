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

// coreFlags registers the flags shared by serve and bench.
func coreFlags(fs *flag.FlagSet, cfg *app.Config) {
	fs.StringVar(&cfg.ModelPath, "m", "", "GGUF model file")
	fs.StringVar(&cfg.ModelPath, "model", "", "GGUF model file (same as -m)")
	fs.IntVar(&cfg.NCtx, "c", 4096, "KV cells in the unified cache (context size shared by all sessions)")
	fs.IntVar(&cfg.NCtx, "ctx-size", 4096, "same as -c")
	fs.IntVar(&cfg.Parallel, "parallel", 4, "session sequences decoding at once")
	fs.IntVar(&cfg.Parallel, "np", 4, "same as --parallel")
	fs.IntVar(&cfg.Threads, "t", 0, "CPU threads (default: all cores)")
	fs.IntVar(&cfg.Threads, "threads", 0, "same as -t")
	fs.IntVar(&cfg.NBatch, "batch", 512, "tokens per decode step (decode tokens + prefill chunks)")
	fs.IntVar(&cfg.NBatch, "b", 512, "same as --batch")
	fs.IntVar(&cfg.NUBatch, "ubatch", 0, "physical micro-batch size (default: --batch)")
	fs.IntVar(&cfg.MaxQueue, "queue", 64, "requests that may wait for a sequence; more get 503")
	fs.DurationVar(&cfg.SessionTTL, "session-ttl", 30*time.Minute, "idle sessions older than this lose their KV")
	fs.StringVar(&cfg.FlashAttn, "flash-attn", "on", "flash attention: on, off or auto. On keeps logits independent of batch shape (pooled == unpooled greedy tokens, bit for bit); off prefills ~1.5x faster at 2k context on CPU but numerics then vary with batch shape")
	fs.StringVar(&cfg.ChatTemplate, "chat-template", "", "chat template to use instead of the GGUF's: a built-in name ("+strings.Join(chat.BuiltinTemplateNames(), ", ")+") or Jinja source")
	fs.StringVar(&cfg.ChatTemplateFile, "chat-template-file", "", "Jinja chat template file to use instead of the GGUF's")
	fs.DurationVar(&cfg.TPSTau, "tps-tau", 2*time.Second, "time constant of the per-session experienced tps EWMA")
	fs.Func("max-pools", "shared-prefix pools (sequence ids reserved above --parallel; default 16, 0 = none)", func(v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return fmt.Errorf("want a non-negative integer")
		}
		cfg.MaxPools = n
		if n == 0 {
			cfg.MaxPools = -1
		}
		return nil
	})
	fs.Func("pool-grace-ms", "a pool is not reclaimed or evicted within this many ms of its last use (default 30000)", func(v string) error {
		n, err := strconv.Atoi(v)
		if err != nil || n < 0 {
			return fmt.Errorf("want a non-negative integer")
		}
		cfg.PoolGrace = time.Duration(n) * time.Millisecond
		if n == 0 {
			cfg.PoolGrace = time.Nanosecond
		}
		return nil
	})
}

func serve(args []string) error {
	fs := flag.NewFlagSet("serve", flag.ExitOnError)
	var cfg app.Config
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
