package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/cilium/hive"
	"github.com/cilium/hive/cell"
	"github.com/spf13/cobra"

	"github.com/identityd/identityd/cells/allocator"
	"github.com/identityd/identityd/cells/k8sclient"
	"github.com/identityd/identityd/cells/kvstore"
	"github.com/identityd/identityd/identity"
	"github.com/identityd/identityd/internal/migrate"
)

// migrateClients are the clients the migration's hive builds.
type migrateClients struct {
	kv  *kvstore.Client
	k8s *k8sclient.Client
}

// newMigrateHive is the hive of `identityd migrate`: the agent's kvstore and
// Kubernetes client cells, so that the flags that connect an agent to
// etcd (--kvstore-*) and to the API server (--k8s-*) connect the migration.
// It runs in crd mode for the cells: no embedded etcd is started, and the
// Kubernetes client is always made.
func newMigrateHive(c *migrateClients) *hive.Hive {
	opts := hive.DefaultOptions()
	opts.EnvPrefix = EnvPrefix
	// Hooks and invokes that take longer than this are logged at info
	// level, as the agent's are.
	opts.LogThreshold = 100 * time.Millisecond
	return hive.NewWithOptions(opts,
		kvstore.Cell,
		k8sclient.Cell,
		cell.Provide(func() identity.AllocationMode { return identity.AllocationModeCRD }),
		cell.Invoke(func(kv *kvstore.Client, k8s *k8sclient.Client) { c.kv, c.k8s = kv, k8s }),
	)
}

func newMigrateCmd(stdout io.Writer, logOpts *logOptions) *cobra.Command {
	var (
		clients migrateClients
		h       = newMigrateHive(&clients)
		o       = migrate.Options{Cluster: identity.ClusterInfo{
			ID: allocator.DefaultConfig.ClusterID, Name: allocator.DefaultConfig.ClusterName,
			MaxConnectedClusters: allocator.DefaultConfig.MaxConnectedClusters}}
		from, to, output string
	)
	cmd := &cobra.Command{
		Use:   "migrate --from kvstore|crd --to crd|kvstore [flags]",
		Short: "Copy global identities between the etcd store and CiliumIdentity objects, keeping their IDs",
		Long: "Copies every global identity of one store into the other with the same numeric ID,\n" +
			"as Cilium's `cilium-dbg preflight migrate-identity` does, in either direction.\n" +
			"An ID the target gives another label set is a conflict: the label set gets a new\n" +
			"ID there (or the one the target has for it), and the conflict is reported. The\n" +
			"migrated identities are held against the target's garbage collection for\n" +
			"--migrate-hold. Running it again is safe: it creates only what is missing.\n" +
			"Exits non-zero on errors only, not on conflicts. See docs/guides.md, \"Migrating\n" +
			"between the etcd and the CRD store\".",
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, args []string) error {
			log, err := logOpts.logger(cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if output != "text" && output != "json" {
				return fmt.Errorf("invalid -o %q: want text or json", output)
			}
			o.From, o.To, o.Log = migrate.Store(from), migrate.Store(to), log
			o.Hold = o.Hold.Round(time.Second)
			if err := kvstore.ValidateObjectNodeName(o.HoldNode); err != nil {
				return fmt.Errorf("invalid --migrate-node-name: %w", err)
			}
			if err := o.Validate(); err != nil {
				return err
			}
			if len(h.Viper().GetStringSlice("kvstore-endpoints")) == 0 {
				return errors.New("migrate needs the etcd of the kvstore mode: set --kvstore-endpoints (and its TLS flags); an agent's embedded etcd is not supported")
			}
			ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
			defer stop()
			if err := h.Start(log, ctx); err != nil {
				return err
			}
			defer func() {
				sctx, cancel := context.WithTimeout(context.Background(), time.Minute)
				defer cancel()
				h.Stop(log, sctx)
			}()
			o.Etcd, o.K8s = clients.kv.Client(), clients.k8s.RESTConfig()
			rep, err := migrate.Run(ctx, o)
			if err != nil {
				return err
			}
			if output == "json" {
				enc := json.NewEncoder(stdout)
				enc.SetIndent("", "  ")
				return enc.Encode(rep)
			}
			migrate.WriteText(stdout, rep)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&from, "from", "", "Store to copy from: kvstore (etcd) or crd (CiliumIdentity objects)")
	f.StringVar(&to, "to", "", "Store to copy to: crd or kvstore")
	f.BoolVar(&o.DryRun, "dry-run", false, "Print what would be created and the conflicts; write nothing")
	f.StringVarP(&output, "output", "o", "text", "Output format: text or json")
	f.DurationVar(&o.Hold, "migrate-hold", migrate.DefaultHold, "How long the target keeps the migrated identities while no node uses them (etcd: reference keys on a lease of this TTL; crd: an IdentityNode of this lease)")
	f.StringVar(&o.HoldNode, "migrate-node-name", migrate.DefaultHoldNode, "Node name the migrated identities are held under; no agent may use it")
	f.Uint32Var(&o.Cluster.ID, "cluster-id", o.Cluster.ID, "This cluster's ID, as the agents': source identities outside its range are skipped, new IDs are placed in it")
	f.StringVar(&o.Cluster.Name, "cluster-name", o.Cluster.Name, "This cluster's name, as the agents'")
	f.Uint32Var(&o.Cluster.MaxConnectedClusters, "max-connected-clusters", o.Cluster.MaxConnectedClusters, "255 or 511, as the agents'")
	cmd.MarkFlagRequired("from")
	cmd.MarkFlagRequired("to")
	h.RegisterFlags(f)
	return cmd
}
