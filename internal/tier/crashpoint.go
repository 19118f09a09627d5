package tier

// CrashPoint, when set, is called at the moments a crash test kills a server at, so that
// the kill lands there for certain instead of somewhere near by chance:
//   - "write": a temporary file in the directory holds a whole entry or manifest,
//     synced, not yet renamed to name (its final name: KEY.kv or pools.json);
//   - "read": an entry (name: KEY.kv) is about to be read back from disk (a restore).
//
// Only tests set it (internal/app's TestTierServerKill9, in the server process it then
// kills), before Open and never again; nil, the production value, costs one comparison.
// The hook may block: the store's writer (or the reader) waits with it.
var CrashPoint func(point, name string)

func crashPoint(point, name string) {
	if CrashPoint != nil {
		CrashPoint(point, name)
	}
}
