package bench

import (
	"os"
	"strconv"
	"strings"
	"time"
)

// A benchmark on a shared machine measures the machine as much as the code. foreignCPU
// tells how much CPU other processes used while a run went on (Linux /proc; 0 where it
// cannot be read): the whole machine's busy time less this process's and the servers'
// it started, so a run that shared its cores says so beside its figures.

// clockTick is USER_HZ, the unit of /proc's CPU times (100 on Linux everywhere that
// matters).
const clockTick = 100

// cpuTimes is the machine's busy CPU seconds and the given processes' (this one's
// included), at one moment.
type cpuTimes struct{ machine, own float64 }

func readCPU(pids ...int) cpuTimes {
	var c cpuTimes
	if b, err := os.ReadFile("/proc/stat"); err == nil {
		line, _, _ := strings.Cut(string(b), "\n")
		f := strings.Fields(line)
		// cpu user nice system idle iowait irq softirq steal ...
		for i, v := range f[1:] {
			if i == 3 || i == 4 || i >= 8 {
				continue // idle, iowait; guest time is already in user
			}
			n, _ := strconv.ParseFloat(v, 64)
			c.machine += n / clockTick
		}
	}
	for _, pid := range append([]int{os.Getpid()}, pids...) {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			continue
		}
		// Fields after the command's closing parenthesis: utime and stime are the 12th
		// and 13th of them.
		s := string(b)
		f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
		if len(f) < 13 {
			continue
		}
		for _, v := range f[11:13] {
			n, _ := strconv.ParseFloat(v, 64)
			c.own += n / clockTick
		}
	}
	return c
}

// foreignSince is the CPU seconds other processes used since start.
func foreignSince(start cpuTimes, pids ...int) float64 {
	now := readCPU(pids...)
	return max(0, (now.machine-start.machine)-(now.own-start.own))
}

// waitQuiet waits until other processes use less than frac of one core over a 3 s
// window, or until maxWait has passed; it returns how long it waited and whether the
// machine was quiet.
func waitQuiet(frac float64, maxWait time.Duration) (time.Duration, bool) {
	const window = 3 * time.Second
	start := time.Now()
	for {
		c := readCPU()
		time.Sleep(window)
		if foreignSince(c) < frac*window.Seconds() {
			return time.Since(start), true
		}
		if time.Since(start) >= maxWait {
			return time.Since(start), false
		}
	}
}
