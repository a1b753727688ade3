package ipcache

import (
	"fmt"

	"github.com/spf13/pflag"

	"github.com/identityd/identityd/internal/ipcachemap"
)

// Config is the ipcache's configuration.
type Config struct {
	// IPCacheMap selects the datapath map backend: auto, bpf or file.
	IPCacheMap string
	// IPCacheMapPinPath is where the bpf backend pins its map.
	IPCacheMapPinPath string
	// IPCacheMapMaxEntries is the map's capacity.
	IPCacheMapMaxEntries uint32
	// IPCacheDualStack labels prefixes with reserved:world-ipv4 or
	// reserved:world-ipv6 instead of reserved:world, as Cilium does when
	// both IPv4 and IPv6 are enabled.
	IPCacheDualStack bool
}

// MaxMapEntries bounds --ipcache-map-max-entries. A BPF LPM trie without
// preallocation costs memory only for the entries in use, but the bound
// keeps a typo from reserving the kernel's whole map budget.
const MaxMapEntries = 1 << 24

// DefaultConfig is the default configuration.
var DefaultConfig = Config{
	IPCacheMap:           string(ipcachemap.KindAuto),
	IPCacheMapPinPath:    ipcachemap.DefaultPinPath,
	IPCacheMapMaxEntries: ipcachemap.DefaultMaxEntries,
	IPCacheDualStack:     false,
}

// Flags registers the ipcache's flags.
func (def Config) Flags(flags *pflag.FlagSet) {
	flags.String("ipcache-map", def.IPCacheMap, "Datapath map backend of the ipcache: auto (bpf when a map can be created and pinned, else file), bpf, or file (<state-dir>/"+ipcachemap.FileName+")")
	flags.String("ipcache-map-pin-path", def.IPCacheMapPinPath, "Pin path of the ipcache's BPF map (identityd's own map, never Cilium's)")
	flags.Uint32("ipcache-map-max-entries", def.IPCacheMapMaxEntries, fmt.Sprintf("Capacity of the ipcache map (1 .. %d)", MaxMapEntries))
	flags.Bool("ipcache-dual-stack", def.IPCacheDualStack, "Give prefixes the world-ipv4/world-ipv6 labels instead of world (Cilium does so when IPv4 and IPv6 are both enabled)")
}

// Validate checks the configuration.
func (c Config) Validate() error {
	switch ipcachemap.Kind(c.IPCacheMap) {
	case ipcachemap.KindAuto, ipcachemap.KindBPF, ipcachemap.KindFile:
	default:
		return fmt.Errorf("invalid --ipcache-map %q (want auto, bpf or file)", c.IPCacheMap)
	}
	if c.IPCacheMapMaxEntries == 0 || c.IPCacheMapMaxEntries > MaxMapEntries {
		return fmt.Errorf("invalid --ipcache-map-max-entries %d (want 1 .. %d)", c.IPCacheMapMaxEntries, MaxMapEntries)
	}
	if c.IPCacheMap != string(ipcachemap.KindFile) && c.IPCacheMapPinPath == "" {
		return fmt.Errorf("--ipcache-map-pin-path must not be empty with --ipcache-map=%s", c.IPCacheMap)
	}
	return nil
}
