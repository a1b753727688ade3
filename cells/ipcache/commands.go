package ipcache

import (
	"errors"
	"fmt"
	"net/netip"
	"strconv"
	"strings"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/durability"
	"github.com/identityd/identityd/internal/shellfmt"
	"github.com/identityd/identityd/labels"
)

// DefaultShellOwner is the owner of contributions made from the shell.
const DefaultShellOwner ResourceID = "shell"

// newCommands returns the ipcache/* commands; ipcache/upsert applies and
// waits for the durability point within --identity-allocation-timeout (the
// allocator's configuration), as identity/allocate does, so that its
// caller gets an answer within that bound when the store or the disk
// stalls.
func newCommands(c *IPCache, cfg allocator.Config) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"ipcache/upsert":   upsertCmd(c, cfg.IdentityAllocationTimeout),
		"ipcache/delete":   deleteCmd(c, cfg.IdentityAllocationTimeout),
		"ipcache/lookup":   lookupCmd(c),
		"ipcache/list":     listCmd(c),
		"ipcache/map-dump": mapDumpCmd(c),
	})
}

// errZone is why an address or prefix with an IPv6 zone is refused: an
// identity is for an address, whatever the interface it was seen on, and
// netip would drop the zone of a bare address silently.
var errZone = errors.New("IPv6 zones are not allowed (identities do not carry zones): give the address without %zone")

// parsePrefix accepts a prefix or a bare address (a /32 or /128), without
// an IPv6 zone.
func parsePrefix(s string) (netip.Prefix, error) {
	if strings.Contains(s, "%") {
		return netip.Prefix{}, fmt.Errorf("%w %q: %w", ErrInvalidPrefix, s, errZone)
	}
	if strings.Contains(s, "/") {
		p, err := netip.ParsePrefix(s)
		if err != nil {
			return p, fmt.Errorf("%w: %w", ErrInvalidPrefix, err)
		}
		return p, nil
	}
	a, err := netip.ParseAddr(s)
	if err != nil {
		return netip.Prefix{}, fmt.Errorf("%w: %w", ErrInvalidPrefix, err)
	}
	return netip.PrefixFrom(a, a.BitLen()), nil
}

func parsePrefixes(args []string) ([]netip.Prefix, error) {
	out := make([]netip.Prefix, len(args))
	for i, a := range args {
		p, err := parsePrefix(a)
		if err != nil {
			return nil, err
		}
		out[i] = p
	}
	return out, nil
}

func upsertCmd(c *IPCache, timeout time.Duration) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Set an owner's contribution (labels, requested ID or direct identity) to prefixes",
			Args:    "prefix...",
			Detail: []string{
				"Replaces what the owner said about each prefix before. Examples:",
				"  ipcache/upsert 10.0.0.0/8 2001:db8::/32      (plain CIDR identities)",
				"  ipcache/upsert --owner=kube --labels=reserved:kube-apiserver 192.168.0.1",
				"  ipcache/upsert --owner=restored --requested-id=16777300 192.0.2.0/24",
				"  ipcache/upsert --owner=endpoints --identity=1234 --tunnel-endpoint=10.1.0.1 10.2.0.5",
				"A direct --identity wins over labels; see the package documentation.",
				"It answers at the durability point: once the prefixes are in the datapath",
				"map (and its file) and their local identities in the checkpoint, so that",
				"the answered pairs survive a crash of the agent. --no-wait answers as soon",
				"as the table has them; such an answer may be lost by a SIGKILL. If the",
				"allocation and the writes take longer than --identity-allocation-timeout,",
				"the command fails; what the table has by then stays applied.",
			},
			Flags: func(fs *pflag.FlagSet) {
				shellfmt.AddFlag(fs)
				fs.String("owner", string(DefaultShellOwner), "Resource ID of the owner")
				fs.String("labels", "", "Comma-separated labels, source:key=value")
				fs.Uint32("requested-id", 0, "Numeric identity to ask for when no owner gives labels")
				fs.Uint32("identity", 0, "Direct identity (no allocation)")
				fs.String("tunnel-endpoint", "", "IPv4 tunnel endpoint (with --identity)")
				fs.Uint8("encrypt-key", 0, "Encryption key index (with --identity)")
				fs.Bool("no-wait", false, "Answer before the pairs are durable (in the map and the checkpoint)")
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			// A bad -o must fail before the upsert, not after it.
			if _, err := shellfmt.Format(s.Flags); err != nil {
				return nil, err
			}
			prefixes, err := parsePrefixes(args)
			if err != nil {
				return nil, err
			}
			owner, _ := s.Flags.GetString("owner")
			var info Info
			if l, _ := s.Flags.GetString("labels"); l != "" {
				if info.Labels, err = labels.ParseList(l); err != nil {
					return nil, err
				}
			}
			req, _ := s.Flags.GetUint32("requested-id")
			id, _ := s.Flags.GetUint32("identity")
			info.RequestedID, info.Identity = identity.NumericIdentity(req), identity.NumericIdentity(id)
			if te, _ := s.Flags.GetString("tunnel-endpoint"); te != "" {
				if info.TunnelEndpoint, err = netip.ParseAddr(te); err != nil {
					return nil, fmt.Errorf("invalid tunnel endpoint: %w", err)
				}
			}
			info.EncryptKey, _ = s.Flags.GetUint8("encrypt-key")
			updates := make([]Update, len(prefixes))
			for i, p := range prefixes {
				updates[i] = Update{Prefix: p, Info: info}
			}
			// One bound for the allocation and the waits for the map
			// and the disk together.
			ctx, cancel := durability.Bound(s.Context(), timeout)
			defer cancel()
			if err := c.UpsertBatch(ctx, ResourceID(owner), updates); err != nil {
				if within := durability.Within(ctx); within != "" {
					return nil, fmt.Errorf("not all applied%s (the prefixes named here are left as they were): %w", within, err)
				}
				return nil, err
			}
			if noWait, _ := s.Flags.GetBool("no-wait"); !noWait {
				if err := c.WaitDurable(ctx, prefixes...); err != nil {
					// The table keeps the rows: the reconciler and the
					// checkpoint write them once they can, and a repeated
					// upsert holds no second reference.
					return nil, fmt.Errorf("applied to the ipcache table, but not durable%s: %w", durability.Within(ctx), err)
				}
			}
			var rows []*Entry
			for _, p := range prefixes {
				if e, ok := c.LookupPrefix(p); ok {
					rows = append(rows, e)
				}
			}
			return shellfmt.Output(s.Flags, rows)
		},
	)
}

func deleteCmd(c *IPCache, timeout time.Duration) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Remove an owner's contributions to prefixes, or all of them with --all",
			Args:    "prefix...",
			Detail: []string{
				"It answers at the durability point, as ipcache/upsert does: once the",
				"removal is in the datapath map (and its file's journal), so that a",
				"removed prefix stays removed after a crash of the agent. --no-wait",
				"answers as soon as the table has it; such a removal may be undone by a",
				"SIGKILL. If the writes take longer than --identity-allocation-timeout,",
				"the command fails; the removal stays applied.",
			},
			Flags: func(fs *pflag.FlagSet) {
				fs.String("owner", string(DefaultShellOwner), "Resource ID of the owner")
				fs.Bool("all", false, "Remove every contribution of the owner")
				fs.Bool("no-wait", false, "Answer before the removal is durable (in the map)")
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			owner, _ := s.Flags.GetString("owner")
			all, _ := s.Flags.GetBool("all")
			noWait, _ := s.Flags.GetBool("no-wait")
			ctx, cancel := durability.Bound(s.Context(), timeout)
			defer cancel()
			wait := func(prefixes []netip.Prefix) error {
				if noWait {
					return nil
				}
				if err := c.WaitDurable(ctx, prefixes...); err != nil {
					return fmt.Errorf("removed from the ipcache table, but not durable%s: %w", durability.Within(ctx), err)
				}
				return nil
			}
			if all {
				if len(args) > 0 {
					return nil, errors.New("--all takes no prefixes")
				}
				var prefixes []netip.Prefix
				for _, e := range c.ListOwner(ResourceID(owner)) {
					prefixes = append(prefixes, e.Prefix)
				}
				n, err := c.RemoveOwner(ctx, ResourceID(owner))
				if err != nil {
					return nil, err
				}
				if err := wait(prefixes); err != nil {
					return nil, err
				}
				msg := fmt.Sprintf("removed %d prefixes of owner %s\n", n, owner)
				return func(*script.State) (string, string, error) { return msg, "", nil }, nil
			}
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			prefixes, err := parsePrefixes(args)
			if err != nil {
				return nil, err
			}
			if err := c.Remove(ctx, ResourceID(owner), prefixes...); err != nil {
				return nil, err
			}
			return nil, wait(prefixes)
		},
	)
}

func lookupCmd(c *IPCache) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Find the longest prefix that contains an address",
			Args:    "ip",
			Flags:   shellfmt.AddFlag,
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 1 {
				return nil, script.ErrUsage
			}
			if strings.Contains(args[0], "%") {
				return nil, fmt.Errorf("invalid address %q: %w", args[0], errZone)
			}
			addr, err := netip.ParseAddr(args[0])
			if err != nil {
				return nil, fmt.Errorf("invalid address: %w", err)
			}
			e, ok := c.Lookup(addr)
			if !ok {
				return nil, fmt.Errorf("no prefix contains %s", addr)
			}
			return shellfmt.Output(s.Flags, []*Entry{e})
		},
	)
}

func listCmd(c *IPCache) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "List the ipcache table",
			Flags: func(fs *pflag.FlagSet) {
				shellfmt.AddFlag(fs)
				fs.String("owner", "", "Only prefixes this owner contributes to")
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if owner, _ := s.Flags.GetString("owner"); owner != "" {
				return shellfmt.Output(s.Flags, c.ListOwner(ResourceID(owner)))
			}
			return shellfmt.Output(s.Flags, c.List())
		},
	)
}

// MapRow is one datapath map entry as ipcache/map-dump prints it.
type MapRow struct {
	Prefix         netip.Prefix             `json:"prefix"`
	ClusterID      uint16                   `json:"cluster-id,omitempty"`
	Identity       identity.NumericIdentity `json:"identity"`
	TunnelEndpoint netip.Addr               `json:"tunnel-endpoint,omitzero"`
	EncryptKey     uint8                    `json:"encrypt-key,omitempty"`
	Flags          uint8                    `json:"flags,omitempty"`
}

// TableHeader names the columns of ipcache/map-dump's table.
func (MapRow) TableHeader() []string {
	return []string{"Prefix", "Cluster", "Identity", "TunnelEndpoint", "EncryptKey", "Flags"}
}

// TableRow is r as a row of ipcache/map-dump's table.
func (r MapRow) TableRow() []string {
	te := ""
	if r.TunnelEndpoint.IsValid() {
		te = r.TunnelEndpoint.String()
	}
	return []string{
		r.Prefix.String(), strconv.Itoa(int(r.ClusterID)), r.Identity.String(), te,
		strconv.Itoa(int(r.EncryptKey)), strconv.Itoa(int(r.Flags)),
	}
}

func mapRow(e MapEntry) MapRow {
	return MapRow{
		Prefix: e.Key.Prefix, ClusterID: e.Key.ClusterID, Identity: e.Value.Identity,
		TunnelEndpoint: e.Value.TunnelEndpoint, EncryptKey: e.Value.EncryptKey, Flags: e.Value.Flags,
	}
}

func mapDumpCmd(c *IPCache) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Show what the datapath map holds now",
			Flags:   shellfmt.AddFlag,
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			entries, err := c.MapDump()
			if err != nil {
				return nil, err
			}
			rows := make([]MapRow, len(entries))
			for i, e := range entries {
				rows[i] = mapRow(e)
			}
			if len(rows) == 0 {
				shellfmt.Notef(s, "map (%s) is empty\n", c.MapKind())
			}
			return shellfmt.Output(s.Flags, rows)
		},
	)
}
