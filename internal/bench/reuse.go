package bench

import "github.com/polykv/polykv/internal/app"

// cacheReuseOffFlag is how the server flag that turns automatic prefix reuse off is
// spelled, for the benchmark's headings.
const cacheReuseOffFlag = "--prefix-cache off"

// withCacheReuse returns cfg with automatic prefix reuse on or off (--prefix-cache).
func withCacheReuse(cfg app.Config, on bool) app.Config {
	cfg.PrefixCache = "off"
	if on {
		cfg.PrefixCache = "on"
	}
	return cfg
}
