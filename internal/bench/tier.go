package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"time"
	"unsafe"

	"github.com/polykv/polykv/internal/app"
	"github.com/polykv/polykv/internal/engine"
	"github.com/polykv/polykv/internal/tier"
	"golang.org/x/sys/unix"
)

// tierBench is issue 25's workload: a pool of --tier-tokens evicted and attached again,
// its KV restored from RAM and from disk against a full prefill; then a restart with
// --tier-pinned pinned pools, timed until the first attach is served from restored KV.
type tierBench struct {
	tokens, pinned int
}

func (tb tierBench) run(cfg app.Config, reps int) error {
	root, _, err := fanout{root: tb.tokens}.prompts(cfg.ModelPath, nil)
	if err != nil {
		return err
	}
	c := cfg
	c.PrefixCache, c.MaxPools, c.PoolGrace = "off", max(tb.pinned, 2), 0
	c.NCtx = max(c.NCtx, (tb.pinned+1)*(tb.tokens+64))
	fmt.Printf("tier: a %d-token pool evicted, then attached (1 decoded token); best of %d; disk: the file just written (page cache warm), disk-cold: its pages dropped from the page cache first (posix_fadvise DONTNEED, checked with mincore)\n\n", tb.tokens, reps)
	fmt.Println("source     restore ms  attach ms  prefill ms  prefill/restore")
	for _, src := range []string{"ram", "disk", "disk-cold"} {
		c := c
		c.PoolDir = ""
		where := tier.RAM
		if src != "ram" {
			where = tier.Disk
			dir, err := os.MkdirTemp("", "polykv-tier-bench-")
			if err != nil {
				return err
			}
			defer os.RemoveAll(dir)
			c.PoolRAMMB, c.PoolDir = 0, dir
		}
		restore, attach, prefill := time.Duration(1<<62), time.Duration(1<<62), time.Duration(1<<62)
		for range reps {
			r, a, p, err := tb.once(c, root, where, src == "disk-cold")
			if err != nil {
				return err
			}
			restore, attach, prefill = min(restore, r), min(attach, a), min(prefill, p)
		}
		fmt.Printf("%-9s  %10.1f  %9.1f  %10.1f  %15.1f\n", src, ms(restore), ms(attach), ms(prefill), ms(prefill)/ms(restore))
	}
	return tb.restart(c, root)
}

// dropPageCache drops the page cache's copy of every file under dir (fsynced: dirty
// pages are not dropped) and returns how many of their pages are still resident,
// counted with mincore. Per file, rather than echo 3 > /proc/sys/vm/drop_caches: that
// needs root and empties the cache of every other process on the machine too.
func dropPageCache(dir string) (resident, total int, err error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return 0, 0, err
	}
	for _, e := range ents {
		if !e.Type().IsRegular() {
			continue // the shared level's ends/ markers: empty files in folders
		}
		f, err := os.Open(filepath.Join(dir, e.Name()))
		if err != nil {
			return 0, 0, err
		}
		r, n, err := dropFile(f)
		f.Close()
		if err != nil {
			return 0, 0, err
		}
		resident, total = resident+r, total+n
	}
	return resident, total, nil
}

func dropFile(f *os.File) (resident, total int, err error) {
	info, err := f.Stat()
	if err != nil || info.Size() == 0 {
		return 0, 0, err
	}
	fd := int(f.Fd())
	if err := f.Sync(); err != nil {
		return 0, 0, err
	}
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
		return 0, 0, err
	}
	m, err := unix.Mmap(fd, 0, int(info.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return 0, 0, err
	}
	defer unix.Munmap(m)
	vec := make([]byte, (len(m)+os.Getpagesize()-1)/os.Getpagesize())
	// x/sys has no mincore wrapper for Linux.
	if _, _, e := unix.Syscall(unix.SYS_MINCORE, uintptr(unsafe.Pointer(&m[0])), uintptr(len(m)), uintptr(unsafe.Pointer(&vec[0]))); e != 0 {
		return 0, 0, e
	}
	for _, v := range vec {
		resident += int(v & 1)
	}
	return resident, len(vec), nil
}

// once creates the pool (timing its prefill), evicts it, attaches and reads the tier's
// own restore time (read, verify, load into llama.cpp).
func (tb tierBench) once(c app.Config, root []int32, where tier.Location, cold bool) (time.Duration, time.Duration, time.Duration, error) {
	a, err := app.Open(c, nil)
	if err != nil {
		return 0, 0, 0, err
	}
	defer a.Close()
	if a.Tier == nil {
		return 0, 0, 0, fmt.Errorf("bench: the tier is off for this model: %s", a.TierOff)
	}
	ctx := context.Background()
	start := time.Now()
	id, _, err := a.Engine.CreatePool(ctx, engine.PoolSpec{Tokens: root})
	if err != nil {
		return 0, 0, 0, err
	}
	prefill := time.Since(start)
	if res, err := a.Engine.Send(ctx, engine.EvictPool{Pool: id}); err != nil || res.Err != nil {
		return 0, 0, 0, fmt.Errorf("evict: %v %v", err, res.Err)
	}
	a.Tier.Flush()
	if cold {
		if r, n, err := dropPageCache(c.PoolDir); err != nil || r > 0 {
			return 0, 0, 0, fmt.Errorf("bench: dropping the entry from the page cache: %v (%d of %d pages still resident)", err, r, n)
		}
	}
	before := a.Tier.Stats()
	start = time.Now()
	if err := attachOne(ctx, a, id, root); err != nil {
		return 0, 0, 0, err
	}
	attach := time.Since(start)
	after := a.Tier.Stats()
	if after.Restores[where] != before.Restores[where]+1 {
		return 0, 0, 0, fmt.Errorf("bench: the attach was not restored from %s (restores %v, misses %v)", where, after.Restores, after.Misses)
	}
	secs := after.RestoreSeconds[where] - before.RestoreSeconds[where]
	return time.Duration(secs * float64(time.Second)), attach, prefill, nil
}

func attachOne(ctx context.Context, a *app.App, id int, prefix []int32) error {
	st, _, err := a.Engine.Submit(ctx, engine.Request{Prompt: append(slices.Clone(prefix), 13), HasPool: true, PoolID: id, MaxTokens: 1, IgnoreEOS: true})
	if err != nil {
		return err
	}
	evs, err := st.Collect(ctx)
	if err != nil {
		return err
	}
	if last := evs[len(evs)-1]; last.Err != nil || last.Stats.CacheN != len(prefix) {
		return fmt.Errorf("bench: attach: %v, cache_n %d of %d", last.Err, last.Stats.CacheN, len(prefix))
	}
	return nil
}

// restart records --tier-pinned pinned pools, closes the server and opens it again on
// the same --pool-dir: the time from Open until the first attach is served from KV
// restored from disk, against prefilling one pool.
func (tb tierBench) restart(c app.Config, root []int32) error {
	dir, err := os.MkdirTemp("", "polykv-tier-restart-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	c.PoolDir = dir
	a, err := app.Open(c, nil)
	if err != nil {
		return err
	}
	ctx := context.Background()
	var ids []int
	var prefill time.Duration
	for i := range tb.pinned {
		toks := slices.Clone(root)
		toks[len(toks)-1] = int32(100 + i) // distinct prefixes
		start := time.Now()
		id, _, err := a.Engine.CreatePool(ctx, engine.PoolSpec{Tokens: toks, Pin: true})
		if err != nil {
			a.Close()
			return err
		}
		prefill = time.Since(start)
		ids = append(ids, id)
	}
	a.Close()
	r, n, err := dropPageCache(dir)
	if err != nil {
		return err
	}
	start := time.Now()
	b, err := app.Open(c, nil)
	if err != nil {
		return err
	}
	defer b.Close()
	opened := time.Since(start)
	toks := slices.Clone(root)
	toks[len(toks)-1] = 100
	if err := attachOne(ctx, b, ids[0], toks); err != nil {
		return err
	}
	first := time.Since(start)
	st := b.Tier.Stats()
	fmt.Printf("\nrestart: %d pinned pools of %d tokens, their files dropped from the page cache (%d of %d pages still resident); Open (model load, manifest and entry checks) %.0f ms; first attach served %.0f ms after Open began (restores from disk so far: %d, misses %v); prefilling one pool instead: %.0f ms\n",
		tb.pinned, tb.tokens, r, n, ms(opened), ms(first), st.Restores[tier.Disk], st.Misses, ms(prefill))
	return nil
}
