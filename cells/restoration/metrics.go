package restoration

import (
	"github.com/identityd/identityd/cells/metrics"
)

// Values of the result label of identityd_identity_restoration_prefixes.
const (
	prefixesRestored = "restored"
	prefixesFailed   = "failed"
)

// labelReason is the label of identityd_identity_restoration_skipped_map_entries_total.
const labelReason = "reason"

// Values of the reason label of
// identityd_identity_restoration_skipped_map_entries_total: an old map
// entry whose ID the checkpoint gives to the CIDR label set of another
// prefix, which the map gives that ID too (shared_id) or not (other_labels).
const (
	skippedSharedID    = "shared_id"
	skippedOtherLabels = "other_labels"
)

// labelWhat is the label of identityd_identity_restoration_damage, and
// its values.
const (
	labelWhat       = "what"
	damageJournal   = "journal_damaged"
	damageSalvaged  = "journal_salvaged_records"
	damageLostBytes = "journal_lost_bytes"
	damageWithheld  = "withheld_ids"
	damageUnknown   = "withheld_unknown_ids"
	damageMap       = "map_journal_damaged"
	damageMapSalv   = "map_journal_salvaged_records"
	damageMapLost   = "map_journal_lost_bytes"
)

// newRestorationMetrics contributes the restorer's collector.
func newRestorationMetrics(r *Restorer) metrics.CollectorOut {
	return metrics.NewCollector(newRestorationCollector(r))
}

// newRestorationCollector reports what the restoration at this start did,
// read from the restorer's counters at scrape time. Gauges, because the
// values describe the one restoration of this process; a restart starts
// them again from zero.
func newRestorationCollector(r *Restorer) *metrics.ScrapeCollector {
	var (
		identities = metrics.NewDesc("identity_restoration",
			"Number of checkpointed identities by what restoration did with them at this start: restored, skipped, released_after_grace",
			metrics.LabelResult)
		prefixes = metrics.NewDesc("identity_restoration_prefixes",
			"Number of prefixes of the old datapath map that restoration re-created in the ipcache at this start (restored) or the ipcache refused (failed)",
			metrics.LabelResult)
		skippedMapEntries = metrics.NewDesc("identity_restoration_skipped_map_entries_total",
			"Number of old datapath map entries restoration skipped because the checkpoint gives their ID to another prefix's label set, by reason: shared_id, other_labels",
			labelReason)
		damage = metrics.NewDesc("identity_restoration_damage",
			"What restoration found damaged in the state files at this start, by what: journal_damaged (1 when the identity journal was damaged, empty or of another checkpoint), journal_salvaged_records, journal_lost_bytes, withheld_ids (numbers the state files name that were not given back) and withheld_unknown_ids (numbers withheld because damage hid which were answered), both withheld until the grace period ends, and map_journal_damaged, map_journal_salvaged_records, map_journal_lost_bytes (the datapath map file's journal, --ipcache-map=file)",
			labelWhat)
	)
	return metrics.NewScrapeCollector(func(m metrics.Scrape) {
		n := r.Counters()
		m.Gauge(identities, float64(n.Restored), metrics.RestorationRestored)
		m.Gauge(identities, float64(n.Skipped), metrics.RestorationSkipped)
		m.Gauge(identities, float64(n.ReleasedAfterGrace), metrics.RestorationReleasedAfterGrace)
		m.Gauge(prefixes, float64(n.PrefixesRestored), prefixesRestored)
		m.Gauge(prefixes, float64(n.PrefixesFailed), prefixesFailed)
		// A counter: restoration only adds to it, and a restart starts a new
		// process, which Prometheus reads as a counter reset.
		m.Counter(skippedMapEntries, float64(n.MapEntriesSharedID), skippedSharedID)
		m.Counter(skippedMapEntries, float64(n.MapEntriesOtherLabels), skippedOtherLabels)
		st := r.Status()
		damaged, mapDamaged := 0.0, 0.0
		if st.JournalDamage != nil {
			damaged = 1
		}
		m.Gauge(damage, damaged, damageJournal)
		var mapSalvaged, mapLost float64
		if d := st.MapJournalDamage; d != nil {
			mapDamaged, mapSalvaged, mapLost = 1, float64(d.Salvaged), float64(d.LostBytes)
		}
		m.Gauge(damage, mapDamaged, damageMap)
		m.Gauge(damage, mapSalvaged, damageMapSalv)
		m.Gauge(damage, mapLost, damageMapLost)
		m.Gauge(damage, float64(n.JournalSalvaged), damageSalvaged)
		m.Gauge(damage, float64(n.JournalLostBytes), damageLostBytes)
		m.Gauge(damage, float64(n.SeenWithheld), damageWithheld)
		m.Gauge(damage, float64(n.UnknownWithheld), damageUnknown)
	}, identities, prefixes, skippedMapEntries, damage)
}
