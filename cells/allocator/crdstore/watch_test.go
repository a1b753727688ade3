package crdstore

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/identityd/identityd/internal/etcdtest"
	"github.com/identityd/identityd/internal/k8stest"
)

// TestWatchSurvivesServerRestart: a node's cache follows what another node
// creates after the API server restarted under its watch.
func TestWatchSurvivesServerRestart(t *testing.T) {
	t.Parallel()
	srv := startServer(t)
	a := startNode(t, srv.RESTConfig(), "node-a")
	b := startNode(t, srv.RESTConfig(), "node-b")
	before, _ := a.allocate(t, web(1))
	srv.Restart(t)
	var after uint32
	require(t, time.Minute, func() error {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		id, _, err := b.store.Allocate(ctx, web(2), b.refs.Record)
		after = uint32(id)
		return err
	})
	require(t, time.Minute, func() error {
		if id, ok := a.store.LookupByLabels(web(2)); !ok || uint32(id) != after {
			return fmt.Errorf("node-a looks web-2 up as %d (%v), want %d", id, ok, after)
		}
		if _, ok := a.ev.Get(before); !ok {
			return errors.New("node-a lost the identity it made before the restart")
		}
		return nil
	})
	if got, _ := a.allocate(t, web(2)); uint32(got) != after {
		t.Errorf("node-a allocated %d for web-2, node-b %d", got, after)
	}
}

// TestRelistAfterGone: changes made while a node's API server was down,
// then compacted away in etcd, reach the node by a new listing (its watch
// resumes from a resourceVersion the restarted server no longer serves:
// 410 Gone), deletions included.
func TestRelistAfterGone(t *testing.T) {
	t.Parallel()
	etcd := etcdtest.StartSingle(t, etcdtest.WithUnsafeNoFsync())
	s1 := startServer(t, k8stest.WithEtcd(etcd.Endpoints()...))
	// The same prefix: both servers serve the same objects.
	s2 := startBareServer(t, k8stest.WithEtcd(etcd.Endpoints()...), k8stest.WithServerArgs("--etcd-prefix", s1.EtcdPrefix()))
	a := startNode(t, s1.RESTConfig(), "node-a")
	gone, _ := a.allocate(t, web(1))
	a.release(t, gone)

	s1.Stop(t)
	b := startNode(t, s2.RESTConfig(), "node-b")
	kept, _ := b.allocate(t, web(2))
	cli := newClient(t, s2.RESTConfig())
	if err := cli.cilium.Delete().Resource("ciliumidentities").Name(gone.String()).Do(context.Background()).Error(); err != nil {
		t.Fatal(err)
	}
	ec, err := clientv3.New(clientv3.Config{Endpoints: etcd.Endpoints(), DialTimeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer ec.Close()
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	resp, err := ec.Get(ctx, "/")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ec.Compact(ctx, resp.Header.Revision); err != nil {
		t.Fatal(err)
	}
	s1.Restart(t)
	require(t, time.Minute, func() error {
		if _, ok := a.ev.Get(gone); ok {
			return fmt.Errorf("node-a still has %d, deleted while its server was down", gone)
		}
		if id, ok := a.store.LookupByLabels(web(2)); !ok || id != kept {
			return fmt.Errorf("node-a looks web-2 up as %d (%v), want %d", id, ok, kept)
		}
		return nil
	})
}

// TestRegisterCRDsForbidden: without the right to CRDs the start fails
// with an error that names the CRD and the verb refused.
func TestRegisterCRDsForbidden(t *testing.T) {
	t.Parallel()
	srv := startBareServer(t)
	cfg, err := clientcmd.BuildConfigFromFlags("", srv.UserKubeconfig(t, "agent"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	err = RegisterCRDs(ctx, cfg)
	if !errors.Is(err, ErrCRDRegistration) || !strings.Contains(err.Error(), CiliumIdentityCRDName) || !strings.Contains(err.Error(), `"get"`) {
		t.Fatalf("RegisterCRDs as a user without rights: %v", err)
	}
	t.Log(err)
}
