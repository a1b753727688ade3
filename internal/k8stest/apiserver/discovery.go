package main

import (
	"encoding/json"
	"net/http"
	"slices"
	"sync/atomic"

	apiextensionsv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	listers "k8s.io/apiextensions-apiserver/pkg/client/listers/apiextensions/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/labels"
	"k8s.io/apimachinery/pkg/version"
)

// groupList serves the lists of API groups (/apis) and core versions
// (/api) that a kube-apiserver serves and the apiextensions-apiserver
// alone does not (its aggregator does), so that discovery clients, which
// start there, work: the groups are apiextensions.k8s.io and those of the
// established CRDs, their versions in Kubernetes version order, as the
// server's own discovery of each group lists them. There is no core group.
type groupList struct {
	next http.Handler
	crds atomic.Pointer[listers.CustomResourceDefinitionLister] // set once the server exists
}

func (g *groupList) ServeHTTP(w http.ResponseWriter, r *http.Request) {
	lister := g.crds.Load()
	if lister == nil || r.Method != http.MethodGet || (r.URL.Path != "/apis" && r.URL.Path != "/api") {
		g.next.ServeHTTP(w, r)
		return
	}
	var body any
	if r.URL.Path == "/api" {
		body = &metav1.APIVersions{TypeMeta: metav1.TypeMeta{Kind: "APIVersions"}, Versions: []string{}}
	} else {
		crds, err := (*lister).List(labels.Everything())
		if err != nil {
			http.Error(w, err.Error(), http.StatusInternalServerError)
			return
		}
		body = apiGroups(crds)
	}
	b, err := json.Marshal(body)
	if err != nil {
		http.Error(w, err.Error(), http.StatusInternalServerError)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.Write(b)
}

func apiGroups(crds []*apiextensionsv1.CustomResourceDefinition) *metav1.APIGroupList {
	versions := map[string][]string{apiextensionsv1.GroupName: {apiextensionsv1.SchemeGroupVersion.Version}}
	for _, crd := range crds {
		if !established(crd) {
			continue
		}
		for _, v := range crd.Spec.Versions {
			if v.Served && !slices.Contains(versions[crd.Spec.Group], v.Name) {
				versions[crd.Spec.Group] = append(versions[crd.Spec.Group], v.Name)
			}
		}
	}
	list := &metav1.APIGroupList{TypeMeta: metav1.TypeMeta{Kind: "APIGroupList", APIVersion: "v1"}}
	for group, vs := range versions {
		if len(vs) == 0 {
			continue
		}
		slices.SortFunc(vs, func(a, b string) int { return -version.CompareKubeAwareVersionStrings(a, b) })
		g := metav1.APIGroup{Name: group}
		for _, v := range vs {
			g.Versions = append(g.Versions, metav1.GroupVersionForDiscovery{GroupVersion: group + "/" + v, Version: v})
		}
		g.PreferredVersion = g.Versions[0]
		list.Groups = append(list.Groups, g)
	}
	slices.SortFunc(list.Groups, func(a, b metav1.APIGroup) int {
		switch {
		case a.Name < b.Name:
			return -1
		case a.Name > b.Name:
			return 1
		}
		return 0
	})
	return list
}

func established(crd *apiextensionsv1.CustomResourceDefinition) bool {
	for _, c := range crd.Status.Conditions {
		if c.Type == apiextensionsv1.Established {
			return c.Status == apiextensionsv1.ConditionTrue
		}
	}
	return false
}
