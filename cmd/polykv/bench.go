package main

import (
	"flag"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/bench"
)

// runBench parses "polykv bench": the server's flags (coreFlags) and the workloads'
// own (bench.Options), then runs the workloads (internal/bench).
func runBench(args []string) error {
	fs := flag.NewFlagSet("bench", flag.ExitOnError)
	cfg := app.DefaultConfig()
	coreFlags(fs, &cfg)
	var o bench.Options
	o.Register(fs)
	_ = fs.Parse(args)
	return bench.Run(cfg.Resolved(), &o)
}
