"""The rolegate Kubernetes operator: compiles RoleTables and ProviderPolicies into the
proxy's ConfigMap and reports each resource's verdict on its status."""
