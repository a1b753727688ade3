package k8stest

import (
	"context"
	"errors"
	"fmt"
	"os"
	"sync"
	"testing"
	"time"

	"github.com/identityd/identityd/internal/crdclient"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/client-go/dynamic"
)

// shared is the server of Shared, one per test binary.
var shared struct {
	mu   sync.Mutex
	srv  *Server
	err  error
	life *binaryLife
}

// Shared returns an API server that the tests of a test binary use one
// after the other, started (with opts) by the first call and stopped by
// StopShared, which the package's TestMain calls after m.Run. Starting a
// server and establishing CRDs on it is most of what a short test on a
// server of its own costs. Every call deletes the objects of every CRD
// the server serves, and the Pods and Leases of every namespace but the
// server's own (kube-system, kube-public, kube-node-lease), before it
// returns, so that each test starts from none; the CRDs, namespaces and
// the rest stay. Only tests that do not call t.Parallel
// may use it, and none may stop, kill or restart it.
func Shared(tb testing.TB, opts ...Option) *Server {
	tb.Helper()
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.srv == nil && shared.err == nil {
		shared.life = &binaryLife{TB: tb}
		// Start fails tb, ending its goroutine, if the server does not
		// start: the error then stays for the tests that come after.
		shared.err = errors.New("k8stest: the shared API server did not start (see the first test that used it)")
		shared.srv = Start(shared.life, opts...)
		shared.err = nil
	}
	if shared.err != nil {
		tb.Fatal(shared.err)
	}
	ctx, cancel := context.WithTimeout(tb.Context(), InstallTimeout)
	defer cancel()
	if err := deleteCustomObjects(ctx, shared.srv); err != nil {
		tb.Fatalf("k8stest: emptying the shared API server: %v", err)
	}
	if err := deleteWorkObjects(ctx, shared.srv); err != nil {
		tb.Fatalf("k8stest: emptying the shared API server: %v", err)
	}
	return shared.srv
}

// StopShared stops the server of Shared, if one was started.
func StopShared() {
	shared.mu.Lock()
	defer shared.mu.Unlock()
	if shared.life != nil {
		shared.life.end()
	}
}

// deleteCustomObjects deletes every object of every CRD srv serves and
// waits until none is listed.
func deleteCustomObjects(ctx context.Context, srv *Server) error {
	cfg := srv.RESTConfig()
	cli, err := crdclient.New(cfg)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(cfg)
	if err != nil {
		return err
	}
	crds, err := cli.List(ctx)
	if err != nil {
		return err
	}
	for _, crd := range crds.Items {
		gvr := schema.GroupVersionResource{Group: crd.Spec.Group, Version: storageVersion(&crd), Resource: crd.Spec.Names.Plural}
		res := dyn.Resource(gvr)
		for {
			left, err := res.List(ctx, metav1.ListOptions{})
			if apierrors.IsNotFound(err) {
				break
			}
			if err != nil {
				return fmt.Errorf("listing the %s: %w", gvr.Resource, err)
			}
			if len(left.Items) == 0 {
				break
			}
			// One by one: a namespaced kind has no collection across
			// namespaces to delete.
			for _, obj := range left.Items {
				err := res.Namespace(obj.GetNamespace()).Delete(ctx, obj.GetName(), metav1.DeleteOptions{})
				if err != nil && !apierrors.IsNotFound(err) {
					return fmt.Errorf("deleting %s %s: %w", gvr.Resource, obj.GetName(), err)
				}
			}
			// An object with a finalizer, or one created since.
			if err := sleep(ctx, 100*time.Millisecond); err != nil {
				return fmt.Errorf("the %s are not gone: %w", gvr.Resource, err)
			}
		}
	}
	return nil
}

// The core resources Shared empties, and the label of the leases it
// leaves alone: those of the API server's own identity, which it renews.
var (
	workResources = []schema.GroupVersionResource{
		{Version: "v1", Resource: "pods"},
		{Group: "coordination.k8s.io", Version: "v1", Resource: "leases"},
	}
	serverLeaseLabel = "apiserver.kubernetes.io/identity"
)

// deleteWorkObjects deletes the objects of workResources but the
// server's leases, and waits until none is listed. Pods go at once (no grace period):
// no kubelet confirms the end of a pod bound to a node.
func deleteWorkObjects(ctx context.Context, srv *Server) error {
	dyn, err := dynamic.NewForConfig(srv.RESTConfig())
	if err != nil {
		return err
	}
	now := int64(0)
	for _, gvr := range workResources {
		res := dyn.Resource(gvr)
		for {
			list, err := res.List(ctx, metav1.ListOptions{})
			if err != nil {
				return fmt.Errorf("listing the %s: %w", gvr.Resource, err)
			}
			left := 0
			for _, obj := range list.Items {
				if _, ok := obj.GetLabels()[serverLeaseLabel]; ok {
					continue
				}
				left++
				err := res.Namespace(obj.GetNamespace()).Delete(ctx, obj.GetName(), metav1.DeleteOptions{GracePeriodSeconds: &now})
				if err != nil && !apierrors.IsNotFound(err) {
					return fmt.Errorf("deleting %s %s/%s: %w", gvr.Resource, obj.GetNamespace(), obj.GetName(), err)
				}
			}
			if left == 0 {
				break
			}
			if err := sleep(ctx, 100*time.Millisecond); err != nil {
				return fmt.Errorf("the %s are not gone: %w", gvr.Resource, err)
			}
		}
	}
	return nil
}

// binaryLife is the testing.TB a shared server is started with: it lives
// until StopShared rather than until the test that started it ends. A
// failure while the server starts goes to that test; temporary
// directories and cleanups belong to the test binary.
type binaryLife struct {
	testing.TB // the test that starts the server

	mu       sync.Mutex
	cleanups []func()
}

func (l *binaryLife) Cleanup(f func()) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.cleanups = append(l.cleanups, f)
}

func (l *binaryLife) TempDir() string {
	dir, err := os.MkdirTemp("", "k8stest-shared")
	if err != nil {
		l.Fatalf("k8stest: %v", err)
	}
	l.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

func (l *binaryLife) Context() context.Context { return context.Background() }

// Failed is false: the logs of a shared server are not tied to one test.
func (l *binaryLife) Failed() bool { return false }

func (l *binaryLife) Logf(format string, args ...any) {
	fmt.Fprintf(os.Stderr, format+"\n", args...)
}

func (l *binaryLife) end() {
	l.mu.Lock()
	cleanups := l.cleanups
	l.cleanups = nil
	l.mu.Unlock()
	for i := len(cleanups) - 1; i >= 0; i-- {
		cleanups[i]()
	}
}
