package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"os"
	"strings"

	"github.com/polykv/polykv/internal/app"
)

// apiKeyFlags registers --api-key (repeatable, or comma-separated) and --api-key-file
// (one key per line; blank lines skipped) on serve's flags, as llama-server names them.
// The returned function runs after parsing: it reads the file into cfg.APIKeys.
func apiKeyFlags(fs *flag.FlagSet, cfg *app.Config) func() error {
	var files []string
	fs.Func("api-key", "require 'Authorization: Bearer KEY' on every route but /health (repeatable, or comma-separated)", func(v string) error {
		for _, k := range strings.Split(v, ",") {
			k = strings.TrimSpace(k)
			if k == "" {
				return errors.New("empty API key")
			}
			cfg.APIKeys = append(cfg.APIKeys, k)
		}
		return nil
	})
	fs.Func("api-key-file", "file of API keys, one per line (as --api-key)", func(v string) error {
		files = append(files, v)
		return nil
	})
	return func() error {
		for _, path := range files {
			keys, err := readAPIKeys(path)
			if err != nil {
				return err
			}
			cfg.APIKeys = append(cfg.APIKeys, keys...)
		}
		return nil
	}
}

// readAPIKeys reads one key per line, ignoring surrounding spaces and blank lines. A
// file without any key is an error: starting open when the operator meant to lock the
// server would be the wrong way to fail.
func readAPIKeys(path string) ([]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--api-key-file: %w", err)
	}
	defer f.Close()
	var keys []string
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if k := strings.TrimSpace(sc.Text()); k != "" {
			keys = append(keys, k)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("--api-key-file %s: %w", path, err)
	}
	if len(keys) == 0 {
		return nil, fmt.Errorf("--api-key-file %s holds no key", path)
	}
	return keys, nil
}
