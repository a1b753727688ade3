package k8stest

import (
	"context"
	"fmt"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/crdclient"
	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/rest"
)

// InstallTimeout bounds how long InstallCRD waits for a CRD to be served.
const InstallTimeout = 60 * time.Second

// The API server delays every create of an object of a CRD for 2s while
// the CRD became Established less than 2s ago (customresource_handler.go,
// for servers that have not seen the CRD yet in a highly available setup).
const justEstablished = 2 * time.Second

// InstallCRD creates crds (an existing CRD of a name is left as it is)
// and waits until they are Established and their objects are served, and
// past the API server's delay of creates on a just established CRD, so
// that the test's first create is as fast as the following ones. Several
// CRDs are created together and share that wait.
func InstallCRD(tb testing.TB, cfg *rest.Config, crds ...*apiextensionsv1.CustomResourceDefinition) {
	tb.Helper()
	ctx, cancel := context.WithTimeout(tb.Context(), InstallTimeout)
	defer cancel()
	if err := installCRDs(ctx, cfg, crds); err != nil {
		tb.Fatalf("k8stest: %v", err)
	}
}

func installCRDs(ctx context.Context, cfg *rest.Config, crds []*apiextensionsv1.CustomResourceDefinition) error {
	cli, err := crdclient.New(cfg)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	for _, crd := range crds {
		if _, err := cli.Create(ctx, crd); err != nil && !apierrors.IsAlreadyExists(err) {
			return fmt.Errorf("installing CRD %s: %w", crd.Name, err)
		}
	}
	var latest time.Time
	for _, crd := range crds {
		established, err := waitServed(ctx, cli, dyn, crd)
		if err != nil {
			return fmt.Errorf("installing CRD %s: %w", crd.Name, err)
		}
		if established.After(latest) {
			latest = established
		}
	}
	// The condition's time has a resolution of a second, truncated: waiting
	// until 2s after it is enough for the server, which reads the same value.
	return sleep(ctx, time.Until(latest.Add(justEstablished+50*time.Millisecond)))
}

// waitServed waits until crd is Established and its objects are served,
// and returns when it became Established.
func waitServed(ctx context.Context, crds *crdclient.Client, dyn dynamic.Interface, crd *apiextensionsv1.CustomResourceDefinition) (time.Time, error) {
	var established time.Time
	for {
		got, err := crds.Get(ctx, crd.Name)
		if err != nil {
			return established, err
		}
		if t, ok := establishedSince(got); ok {
			established = t
			break
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return established, fmt.Errorf("not established: %w", err)
		}
	}

	// The handler serves the CRD once its own cache has it, which may be a
	// moment after the condition is stored: list until it answers.
	gvr := schema.GroupVersionResource{Group: crd.Spec.Group, Version: storageVersion(crd), Resource: crd.Spec.Names.Plural}
	for {
		_, err := dyn.Resource(gvr).List(ctx, metav1.ListOptions{Limit: 1})
		if err == nil {
			return established, nil
		}
		if !apierrors.IsNotFound(err) {
			return established, fmt.Errorf("listing %s: %w", gvr.Resource, err)
		}
		if err := sleep(ctx, 20*time.Millisecond); err != nil {
			return established, fmt.Errorf("%s not served: %w", gvr.Resource, err)
		}
	}
}

func establishedSince(crd *apiextensionsv1.CustomResourceDefinition) (time.Time, bool) {
	for _, c := range crd.Status.Conditions {
		if c.Type == apiextensionsv1.Established && c.Status == apiextensionsv1.ConditionTrue {
			return c.LastTransitionTime.Time, true
		}
	}
	return time.Time{}, false
}

func storageVersion(crd *apiextensionsv1.CustomResourceDefinition) string {
	for _, v := range crd.Spec.Versions {
		if v.Storage {
			return v.Name
		}
	}
	if len(crd.Spec.Versions) > 0 {
		return crd.Spec.Versions[0].Name
	}
	return ""
}

func sleep(ctx context.Context, d time.Duration) error {
	if d <= 0 {
		return nil
	}
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C:
		return nil
	}
}
