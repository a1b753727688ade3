package allocator

import (
	"context"
	"fmt"
	"strings"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/cilium/hive/script"
	"github.com/spf13/pflag"

	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/durability"
	"github.com/identityd/identityd/internal/shellfmt"
	"github.com/identityd/identityd/labels"
)

type commandsParams struct {
	cell.In

	Allocator Allocator
	Config    Config
	// LocalSync is the checkpoint's, when the hive has one:
	// identity/allocate waits for it for local identities.
	LocalSync LocalIdentitySyncer `optional:"true"`
}

func newCellCommands(p commandsParams) hive.ScriptCmdsOut {
	return newCommandsSync(p.Allocator, p.LocalSync, p.Config.IdentityAllocationTimeout)
}

// newCommandsSync returns the commands; identity/allocate allocates and
// waits for sync within timeout, so that an answer never comes later than
// the allocation's own bound (a stalled disk makes it fail instead).
func newCommandsSync(a Allocator, sync LocalIdentitySyncer, timeout time.Duration) hive.ScriptCmdsOut {
	return hive.NewScriptCmds(map[string]script.Cmd{
		"identity/allocate": allocateCmd(a, sync, timeout),
		"identity/release":  releaseCmd(a),
		"identity/get":      getCmd(a),
		"identity/list":     listCmd(a),
	})
}

func allocateCmd(a Allocator, sync LocalIdentitySyncer, timeout time.Duration) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Allocate an identity for a label set (one label per argument)",
			Args:    "label...",
			Detail: []string{
				"Labels are given in text form, source:key=value, e.g.",
				"  identity/allocate k8s:app=web k8s:io.kubernetes.pod.namespace=default",
				"  identity/allocate cidr:10.0.0.0/8 reserved:world",
				"Takes one reference; identity/release drops it.",
				"A local identity is answered once it is in the checkpoint on disk, so that",
				"a restart, even after SIGKILL, gives it its number back; --no-wait answers",
				"at once, and such an answer may be lost by a SIGKILL. If the checkpoint",
				"cannot be written within --identity-allocation-timeout, the reference is",
				"dropped again and the command fails.",
			},
			Flags: func(fs *pflag.FlagSet) {
				shellfmt.AddFlag(fs)
				fs.Uint32("old-id", 0, "Ask for this numeric ID (local scopes)")
				fs.Bool("no-wait", false, "Answer before a local identity is in the checkpoint")
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			// A bad -o must fail before the allocation, or the command
			// would fail holding a reference nobody knows of.
			if _, err := shellfmt.Format(s.Flags); err != nil {
				return nil, err
			}
			lbls, err := labels.Parse(args...)
			if err != nil {
				return nil, err
			}
			// One bound for the allocation and the wait for the disk
			// together.
			ctx, cancel := durability.Bound(s.Context(), timeout)
			defer cancel()
			old, _ := s.Flags.GetUint32("old-id")
			id, allocated, err := a.Allocate(ctx, lbls, WithOldID(identity.NumericIdentity(old)))
			if err != nil {
				return nil, err
			}
			if noWait, _ := s.Flags.GetBool("no-wait"); !noWait && sync != nil && id.ID.HasLocalScope() {
				if err := syncIdentity(ctx, sync, id); err != nil {
					// A failed command must not leave a reference
					// nobody knows of: a retry would take another.
					if _, rerr := a.Release(context.WithoutCancel(s.Context()), id); rerr != nil {
						return nil, fmt.Errorf("identity %d allocated but not durable%s: %w; dropping the reference failed too: %w", id.ID, durability.Within(ctx), err, rerr)
					}
					return nil, fmt.Errorf("identity %d not durable%s, reference dropped: %w", id.ID, durability.Within(ctx), err)
				}
			}
			if allocated {
				shellfmt.Notef(s, "allocated new identity %d\n", id.ID)
			}
			return shellfmt.Output(s.Flags, []Entry{entryFor(a, id)})
		},
	)
}

// syncIdentity waits until id is durable, with the syncer's
// SyncIdentities when it has one (one journal write, none for an identity
// already durable), else with a whole Sync.
func syncIdentity(ctx context.Context, sync LocalIdentitySyncer, id *identity.Identity) error {
	if s, ok := sync.(IdentitySyncer); ok {
		return s.SyncIdentities(ctx, id)
	}
	return sync.Sync(ctx)
}

// entryFinder finds one identity's entry without listing the others; the
// cell's allocator implements it.
type entryFinder interface {
	entry(id *identity.Identity) Entry
}

// entryFor finds the entry of an identity, with its reference count.
func entryFor(a Allocator, id *identity.Identity) Entry {
	// A reserved identity stands for more than its own label set (the
	// host with any other labels): the entry shows the set that resolved
	// to it.
	if f, ok := a.(entryFinder); ok {
		e := f.entry(id)
		e.Identity = id
		return e
	}
	// Another implementation of Allocator: only List knows.
	for _, e := range a.List() {
		if e.Identity.ID == id.ID {
			e.Identity = id
			return e
		}
	}
	return Entry{Identity: id}
}

func releaseCmd(a Allocator) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Release one reference on an identity",
			Args:    "id",
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) != 1 {
				return nil, script.ErrUsage
			}
			nid, err := identity.ParseNumericIdentity(args[0])
			if err != nil {
				return nil, err
			}
			if nid.IsReserved() {
				// Release of a reserved identity is a no-op, which
				// "reference dropped" would misreport.
				return nil, fmt.Errorf("identity %d is reserved: it is not reference-counted, there is no reference to release", nid)
			}
			id := a.LookupByID(nid)
			if id == nil {
				return nil, fmt.Errorf("%w: %d", ErrUnknownIdentity, nid)
			}
			released, err := a.Release(s.Context(), id)
			if err != nil {
				return nil, err
			}
			msg := fmt.Sprintf("identity %d: reference dropped\n", nid)
			if released {
				msg = fmt.Sprintf("identity %d: released\n", nid)
			}
			return func(*script.State) (string, string, error) { return msg, "", nil }, nil
		},
	)
}

func getCmd(a Allocator) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "Look up an identity by numeric ID or by labels, without taking a reference",
			Args:    "id | label...",
			Flags:   shellfmt.AddFlag,
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			if len(args) == 0 {
				return nil, script.ErrUsage
			}
			var id *identity.Identity
			if nid, err := identity.ParseNumericIdentity(args[0]); err == nil && len(args) == 1 {
				id = a.LookupByID(nid)
			} else {
				lbls, err := labels.Parse(args...)
				if err != nil {
					return nil, err
				}
				id = a.LookupByLabels(lbls)
			}
			if id == nil {
				return nil, fmt.Errorf("identity %s not found", strings.Join(args, " "))
			}
			return shellfmt.Output(s.Flags, []Entry{entryFor(a, id)})
		},
	)
}

func listCmd(a Allocator) script.Cmd {
	return script.Command(
		script.CmdUsage{
			Summary: "List identities: reserved, local, global and restored",
			Flags: func(fs *pflag.FlagSet) {
				shellfmt.AddFlag(fs)
				fs.String("source", "", "Only identities of this source (reserved, local, global, restored, remote)")
			},
		},
		func(s *script.State, args ...string) (script.WaitFunc, error) {
			source, _ := s.Flags.GetString("source")
			entries := a.List()
			if source != "" {
				kept := entries[:0]
				for _, e := range entries {
					if string(e.Source) == source {
						kept = append(kept, e)
					}
				}
				entries = kept
			}
			return shellfmt.Output(s.Flags, entries)
		},
	)
}
