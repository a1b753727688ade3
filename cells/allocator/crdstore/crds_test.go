package crdstore

import (
	"context"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/crdclient"
)

func TestRegisterCRDsCreatesAndUpdates(t *testing.T) {
	t.Parallel()
	srv := startBareServer(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()
	if err := RegisterCRDs(ctx, srv.RESTConfig()); err != nil {
		t.Fatalf("registering on a server without the CRDs: %v", err)
	}
	crds, err := crdclient.New(srv.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{CiliumIdentityCRDName, IdentityNodeCRDName, IdentityLeaseCRDName} {
		if _, err := crds.Get(ctx, name); err != nil {
			t.Errorf("%s not installed: %v", name, err)
		}
	}

	// An outdated CRD (an older Cilium's, say) is updated; a newer one
	// is left as its owner wrote it.
	setVersion := func(version, description string) {
		t.Helper()
		cur, err := crds.Get(ctx, CiliumIdentityCRDName)
		if err != nil {
			t.Fatal(err)
		}
		cur.Labels[ciliumSchemaVersionLabel] = version
		cur.Spec.Versions[0].Schema.OpenAPIV3Schema.Description = description
		if _, err := crds.Update(ctx, cur); err != nil {
			t.Fatal(err)
		}
	}
	description := func() string {
		t.Helper()
		cur, err := crds.Get(ctx, CiliumIdentityCRDName)
		if err != nil {
			t.Fatal(err)
		}
		return cur.Spec.Versions[0].Schema.OpenAPIV3Schema.Description
	}
	setVersion("1.28.0", "old")
	if err := RegisterCRDs(ctx, srv.RESTConfig()); err != nil {
		t.Fatal(err)
	}
	if got, want := description(), CiliumIdentityCRD().Spec.Versions[0].Schema.OpenAPIV3Schema.Description; got != want {
		t.Errorf("outdated CRD not updated: description %q", got)
	}
	setVersion("1.30.0", "newer")
	if err := RegisterCRDs(ctx, srv.RESTConfig()); err != nil {
		t.Fatal(err)
	}
	if got := description(); got != "newer" {
		t.Errorf("a newer CRD was rewritten: description %q", got)
	}
}
