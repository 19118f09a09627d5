package main

import "github.com/polykv/polykv/internal/app"

// cacheReuseOffFlag is how the server flag that turns automatic prefix reuse off is
// spelled, for the benchmark's headings.
const cacheReuseOffFlag = "--cache-reuse off"

// withCacheReuse returns cfg with automatic prefix reuse on or off.
// TODO(b12): the engine's switch has not landed on this branch yet (p12); until it
// does, both settings run the same server and "auto" measures no reuse.
func withCacheReuse(cfg app.Config, on bool) app.Config {
	_ = on
	return cfg
}
