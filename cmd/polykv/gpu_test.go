package main

import (
	"bytes"
	"flag"
	"io"
	"strings"
	"testing"

	"github.com/polykv/polykv/internal/app"
)

// -ngl takes llama-server's spellings and values; a bad value fails at parse time.
func TestGPUFlags(t *testing.T) {
	if def := parseCore(t); def.GPULayers != "auto" || def.Device != "" || def.SplitMode != "layer" {
		t.Fatalf("defaults: %+v", def)
	}
	for _, tc := range []struct {
		args []string
		want string
	}{
		{[]string{"-ngl", "12"}, "12"}, {[]string{"--n-gpu-layers", "all"}, "all"},
		{[]string{"--gpu-layers=0"}, "0"}, {[]string{"-ngl", "auto"}, "auto"},
	} {
		if got := parseCore(t, tc.args...).GPULayers; got != tc.want {
			t.Fatalf("%v: -ngl %q, want %q", tc.args, got, tc.want)
		}
	}
	set := parseCore(t, "--device", "CUDA0,CUDA1", "-sm", "row")
	if set.Device != "CUDA0,CUDA1" || set.SplitMode != "row" {
		t.Fatalf("--device/--split-mode: %+v", set)
	}
	for _, bad := range []string{"-1", "many", ""} {
		fs := flag.NewFlagSet("serve", flag.ContinueOnError)
		fs.SetOutput(io.Discard)
		cfg := app.DefaultConfig()
		coreFlags(fs, &cfg)
		if err := fs.Parse([]string{"-ngl", bad}); err == nil || !strings.Contains(err.Error(), "auto, all or a layer count") {
			t.Fatalf("-ngl %q: %v, want a parse error", bad, err)
		}
	}
}

// --list-devices on a machine without GPU libraries lists the CPU and says why no GPU.
func TestListDevicesCPUOnly(t *testing.T) {
	dir := t.TempDir()
	t.Setenv(app.LibraryPathEnv, dir)
	var out bytes.Buffer
	listDevices(&out)
	s := out.String()
	if !strings.Contains(s, "GPU library directories: ["+dir+"]") || !strings.Contains(s, "no GPU backend library found") ||
		!strings.Contains(s, "  CPU: ") || !strings.Contains(s, "(CPU, cpu,") {
		t.Fatalf("--list-devices:\n%s", s)
	}
}
