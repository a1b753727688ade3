// Package crdclient reads, creates and updates CustomResourceDefinitions
// (apiextensions.k8s.io/v1) with client-go's REST client.
//
// The generated apiextensions clientset does the same, but it brings in
// client-go's discovery and, through it, the scheme of every built-in
// Kubernetes API group: several hundred packages that the agent and its
// tests would compile for four calls on one resource.
package crdclient

import (
	"context"
	"fmt"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/client-go/rest"
)

// Client is a client of the customresourcedefinitions resource.
type Client struct {
	rc *rest.RESTClient
}

// New returns a client for the API server cfg names.
func New(cfg *rest.Config) (*Client, error) {
	scheme := runtime.NewScheme()
	if err := apiextensionsv1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	c := rest.CopyConfig(cfg)
	gv := apiextensionsv1.SchemeGroupVersion
	c.GroupVersion = &gv
	c.APIPath = "/apis"
	c.NegotiatedSerializer = serializer.NewCodecFactory(scheme).WithoutConversion()
	c.ContentType = runtime.ContentTypeJSON
	if c.UserAgent == "" {
		c.UserAgent = rest.DefaultKubernetesUserAgent()
	}
	rc, err := rest.RESTClientFor(c)
	if err != nil {
		return nil, fmt.Errorf("building the client of %s: %w", gv, err)
	}
	return &Client{rc: rc}, nil
}

const resource = "customresourcedefinitions"

// Get reads the CRD name.
func (c *Client) Get(ctx context.Context, name string) (*apiextensionsv1.CustomResourceDefinition, error) {
	var crd apiextensionsv1.CustomResourceDefinition
	err := c.rc.Get().Resource(resource).Name(name).Do(ctx).Into(&crd)
	return &crd, err
}

// List reads every CRD.
func (c *Client) List(ctx context.Context) (*apiextensionsv1.CustomResourceDefinitionList, error) {
	var list apiextensionsv1.CustomResourceDefinitionList
	err := c.rc.Get().Resource(resource).Do(ctx).Into(&list)
	return &list, err
}

// Create creates crd and returns it as the server stored it.
func (c *Client) Create(ctx context.Context, crd *apiextensionsv1.CustomResourceDefinition) (*apiextensionsv1.CustomResourceDefinition, error) {
	var got apiextensionsv1.CustomResourceDefinition
	err := c.rc.Post().Resource(resource).Body(crd).Do(ctx).Into(&got)
	return &got, err
}

// Update replaces crd, with its resourceVersion as precondition, and
// returns it as the server stored it.
func (c *Client) Update(ctx context.Context, crd *apiextensionsv1.CustomResourceDefinition) (*apiextensionsv1.CustomResourceDefinition, error) {
	var got apiextensionsv1.CustomResourceDefinition
	err := c.rc.Put().Resource(resource).Name(crd.Name).Body(crd).Do(ctx).Into(&got)
	return &got, err
}
