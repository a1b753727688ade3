package migrate

import (
	"fmt"
	"io"
	"time"
)

// WriteText prints the report for a person: the summary, then every
// conflict, label set found elsewhere and skipped entry, and with a dry run
// every identity it would create.
func WriteText(w io.Writer, r *Report) {
	verb := "created"
	if r.DryRun {
		verb = "would create"
	}
	fmt.Fprintf(w, "migrate %s -> %s%s: %d source identities\n", r.From, r.To, map[bool]string{true: " (dry run, nothing written)"}[r.DryRun], r.Source)
	fmt.Fprintf(w, "  %-16s %d (same ID)\n", verb+":", len(r.Created))
	fmt.Fprintf(w, "  %-16s %d\n", "already present:", len(r.Present))
	fmt.Fprintf(w, "  %-16s %d (new IDs: %d %s, the others already in the target)\n", "conflicts:", len(r.Conflicts), r.NewIDsCreated, verb)
	fmt.Fprintf(w, "  %-16s %d (label set already at another ID in the target, not created)\n", "elsewhere:", len(r.Elsewhere))
	fmt.Fprintf(w, "  %-16s %d\n", "skipped:", len(r.Skipped))
	if r.Hold != nil {
		fmt.Fprintf(w, "  held:            %d IDs under node %q until %s\n", r.Hold.IDs, r.Hold.Node, r.Hold.Until.Format(time.RFC3339))
	}
	if len(r.Conflicts) > 0 {
		fmt.Fprintln(w, "conflicts (ID held in the target by another label set):")
		for _, c := range r.Conflicts {
			fmt.Fprintf(w, "  %d %s -> new ID %d (target's %d: %s)\n", c.ID, c.Labels, c.NewID, c.ID, c.TargetLabels)
		}
	}
	if len(r.Elsewhere) > 0 {
		fmt.Fprintln(w, "elsewhere (label set already in the target at other IDs):")
		for _, e := range r.Elsewhere {
			fmt.Fprintf(w, "  %d %s -> target's %v\n", e.ID, e.Labels, e.TargetIDs)
		}
	}
	if len(r.Skipped) > 0 {
		fmt.Fprintln(w, "skipped:")
		for _, s := range r.Skipped {
			fmt.Fprintf(w, "  %s %q: %s\n", s.Name, s.Value, s.Reason)
		}
	}
	if r.DryRun && len(r.Created) > 0 {
		fmt.Fprintln(w, "would create:")
		for _, e := range r.Created {
			fmt.Fprintf(w, "  %d %s\n", e.ID, e.Labels)
		}
	}
}
