// Command apiserver is the Kubernetes API server that serves
// CustomResourceDefinitions and their objects (k8s.io/apiextensions-apiserver
// of this module's version), built by package k8stest so that tests run a
// real API server as a separate process they can stop, kill and restart.
//
// It takes the flags of the apiextensions-apiserver. Unlike that command it
// needs no core Kubernetes API server: delegated authentication and
// authorization work without one (client certificates of --client-ca-file
// authenticate; the group system:masters is allowed everything and every
// other user is forbidden), and it starts no informers of core resources,
// which could never sync and would keep /readyz failing. It serves the lists
// of API groups (/apis) and of core versions (/api, empty), which a
// kube-apiserver serves and discovery clients start from.
package main

import (
	"context"
	"net/http"
	"os"

	"github.com/spf13/cobra"
	"k8s.io/apiextensions-apiserver/pkg/cmd/server/options"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/component-base/cli"
)

func main() {
	ctx := genericapiserver.SetupSignalContext()
	os.Exit(cli.Run(newCommand(ctx)))
}

func newCommand(ctx context.Context) *cobra.Command {
	o := options.NewCustomResourceDefinitionsServerOptions(os.Stdout, os.Stderr)
	// Without a kubeconfig for them, the delegating authenticator and
	// authorizer run without a core API server instead of failing to start.
	o.RecommendedOptions.Authentication.RemoteKubeConfigFileOptional = true
	o.RecommendedOptions.Authorization.RemoteKubeConfigFileOptional = true
	cmd := &cobra.Command{
		Use:   "apiserver",
		Short: "Kubernetes API server for CustomResourceDefinitions, for tests",
		PersistentPreRunE: func(*cobra.Command, []string) error {
			return o.ServerRunOptions.ComponentGlobalsRegistry.Set()
		},
		RunE: func(c *cobra.Command, _ []string) error {
			if err := o.Complete(); err != nil {
				return err
			}
			if err := o.Validate(); err != nil {
				return err
			}
			return run(c.Context(), o)
		},
	}
	cmd.SetContext(ctx)
	o.AddFlags(cmd.Flags())
	return cmd
}

func run(ctx context.Context, o *options.CustomResourceDefinitionsServerOptions) error {
	config, err := o.Config()
	if err != nil {
		return err
	}
	// The informers of core resources (services, for conversion webhooks)
	// would list from the core API server given by --kubeconfig, which tests
	// do not have: not starting them keeps /readyz truthful.
	config.GenericConfig.SharedInformerFactory = nil
	// The group list goes behind authentication and authorization, like
	// every other path.
	groups := &groupList{}
	config.GenericConfig.BuildHandlerChainFunc = func(h http.Handler, c *genericapiserver.Config) http.Handler {
		groups.next = h
		return genericapiserver.DefaultBuildHandlerChain(groups, c)
	}
	server, err := config.Complete().New(genericapiserver.NewEmptyDelegate())
	if err != nil {
		return err
	}
	lister := server.Informers.Apiextensions().V1().CustomResourceDefinitions().Lister()
	groups.crds.Store(&lister)
	return server.GenericAPIServer.PrepareRun().RunWithContext(ctx)
}
