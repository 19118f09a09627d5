package main

import (
	"flag"
	"fmt"
	"io"
	"os"

	"github.com/polykv/polykv/internal/app"
)

// gpuFlags registers the GPU offload flags (llama-server's names), bound to cfg. The
// values are checked while parsing, so a typo fails before the model is read.
func gpuFlags(fs *flag.FlagSet, cfg *app.Config) {
	ngl := func(v string) error {
		if _, _, err := app.ParseGPULayers(v); err != nil {
			return err
		}
		cfg.GPULayers = v
		return nil
	}
	nglUsage := fmt.Sprintf("layers to offload to the GPU: auto (every layer when a GPU device exists, else the CPU), all (a GPU is required) or N; 0 keeps everything on the CPU (default %s)", cfg.GPULayers)
	fs.Func("ngl", nglUsage, ngl)
	fs.Func("n-gpu-layers", "same as -ngl", ngl)
	fs.Func("gpu-layers", "same as -ngl", ngl)
	fs.StringVar(&cfg.Device, "device", cfg.Device, "GPU devices to offload to, comma-separated (see --list-devices); none: the CPU only; empty: every GPU")
	fs.StringVar(&cfg.Device, "dev", cfg.Device, "same as --device")
	fs.StringVar(&cfg.SplitMode, "split-mode", cfg.SplitMode, "how several GPUs share the model: layer, row or none")
	fs.StringVar(&cfg.SplitMode, "sm", cfg.SplitMode, "same as --split-mode")
	fs.BoolFunc("list-devices", "list the compute devices (after loading the GPU libraries from lib/ or $"+app.LibraryPathEnv+") and exit", func(string) error {
		listDevices(os.Stdout)
		os.Exit(0)
		return nil
	})
}

// listDevices prints where GPU libraries were looked for, how each loaded, and every
// device ggml then has.
func listDevices(w io.Writer) {
	dirs, libs, devices := app.ListDevices()
	fmt.Fprintf(w, "GPU library directories: %v\n", dirs)
	if len(libs) == 0 {
		fmt.Fprintln(w, "  no GPU backend library found (make build-cuda puts one in lib/)")
	}
	for _, l := range libs {
		switch {
		case l.Error != "":
			fmt.Fprintf(w, "  %s: not loaded: %s\n", l.Path, l.Error)
		default:
			fmt.Fprintf(w, "  %s: %s backend, %d device(s)\n", l.Path, l.Backend, l.Devices)
		}
	}
	fmt.Fprintln(w, "Available devices:")
	for _, d := range devices {
		fmt.Fprintf(w, "  %s: %s (%s, %s, %d MiB total, %d MiB free)\n", d.Name, d.Description, d.Backend, d.Type, d.TotalBytes>>20, d.FreeBytes>>20)
	}
}
